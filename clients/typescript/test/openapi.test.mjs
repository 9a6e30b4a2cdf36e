// The committed wire types are what openapi-typescript makes of the served
// document, and the client has an error class for every code it names.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { after, before, test } from "node:test";
import { CLIENT_ERROR_CODES, ERROR_CODES, errorFromResponse } from "../dist/index.js";
import { OPENAPI_TS, generate } from "../scripts/gen.mjs";
import { startServer } from "./helpers.mjs";

let server;
before(async () => { server = await startServer(); });
after(async () => { await server?.stop(); });

test("src/openapi.ts is what `npm run gen` generates from the served /openapi.json (else: run it and rebuild)", async () => {
  assert.equal(await generate(server.url), readFileSync(OPENAPI_TS, "utf8"));
});

test("every ErrorCode in the served document has an error class, and no class a code the server does not send", async () => {
  const document = await (await fetch(`${server.url}/openapi.json`)).json();
  const served = document.components.schemas.ErrorCode.enum;
  assert.deepEqual([...ERROR_CODES].sort(), [...served].sort());
  for (const code of served) {
    const error = errorFromResponse(409, { error: { code, message: "m" } }, null);
    assert.equal(error.code, code, `${code} is thrown as ${error.constructor.name}`);
    assert.notEqual(error.constructor.name, "UnexpectedResponse");
  }
  assert.deepEqual(CLIENT_ERROR_CODES.filter((code) => served.includes(code)), [], "a client-side code is also one the server sends");
});
