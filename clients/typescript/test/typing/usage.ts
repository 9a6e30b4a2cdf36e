// Checked by `tsc --strict` (test/typing.test.mjs), never run: what a
// TypeScript caller sees of the client's API.

import {
  Gate,
  QueueTimeout,
  RecoveryWorker,
  TurnCancelled,
  type TurnEvent,
  type ToolOptions,
  type Turn,
  type TurnOutcome,
} from "../../dist/index.js";

const gate = new Gate({ baseUrl: "http://127.0.0.1:7700" });

interface BookArgs { amount: number; category: string }
interface Entry { entryId: number; amount: number }

export async function body(turn: Turn<{ text: string }>): Promise<{ text: string; entry: Entry }> {
  // turn.tool<A, R>: the same order as ToolOptions<A, R>.
  const options: ToolOptions<BookArgs, Entry> = { run: (ctx) => ({ entryId: 1, amount: ctx.args.amount }) };
  const entry: Entry = await turn.tool<BookArgs, Entry>("book", { amount: 18, category: "taxi" }, options);
  const inferred: Entry = await turn.tool("book", { amount: 18, category: "taxi" }, options);
  // @ts-expect-error: the args' type comes first, so a result type there is refused.
  await turn.tool<Entry, BookArgs>("book", { amount: 18, category: "taxi" }, options);
  turn.partial = { text: "so far" };
  turn.checkCancelled();
  const stop: AbortSignal = turn.signal;
  void stop;
  return { text: `${turn.payload.text}: ${inferred.entryId}`, entry };
}

export async function outcomes(): Promise<number> {
  const outcome: TurnOutcome<{ text: string; entry: Entry }> = await gate.run(
    { userId: "u", sessionId: "s", clientRequestId: "m", payload: { text: "taxi 18" }, onBusy: "enqueue", onQueued: (position: number) => void position },
    body,
  );
  const replayed: boolean = outcome.replayed;
  const value: { text: string } | undefined = outcome.value;
  void value;
  await gate.setPolicy("s", "u", { onBusy: "supersede", interruptRunning: true });
  // @ts-expect-error: not a policy the server has.
  await gate.setPolicy("s", "u", { onBusy: "queue" });
  await gate.cancel("turn_1");
  try {
    await gate.turn({ userId: "u", sessionId: "s", clientRequestId: "m", payload: null, onBusy: "interrupt", busyWaitMs: 5000 }, () => 1);
  } catch (error) {
    if (error instanceof QueueTimeout) return error.position;
    if (error instanceof TurnCancelled) return 0;
  }
  return replayed ? 1 : 2;
}

export async function drainFollowRecover(signal: AbortSignal): Promise<number> {
  // gate.drain from a session id or a request: one outcome per turn, typed by the body.
  const drained: TurnOutcome<string>[] = await gate.drain("s", (turn: Turn<unknown>) => `${turn.clientRequestId} done`, { maxTurns: 5, signal });
  const fromRequest: TurnOutcome<number>[] = await gate.drain({ userId: "u", sessionId: "s", clientRequestId: "m", payload: { n: 1 } }, (turn) => turn.payload.n);
  // @ts-expect-error: a drain's options have no such field.
  await gate.drain("s", () => 1, { takeNext: true });
  let tokens = "";
  for await (const event of gate.follow("turn_1", { after: 0, baseUrls: ["http://a:7700", "http://b:7700"], signal })) {
    const seen: TurnEvent = event;
    if (seen.name === "token" && typeof seen.data === "string") tokens += seen.data;
    if (seen.id === null) return seen.state === "succeeded" ? tokens.length : -1;
  }
  const worker = new RecoveryWorker(gate, async (turn: Turn<{ amount: number }>) => {
    turn.emit("status", { amount: turn.payload.amount });
    const last: number | undefined = await turn.flush();
    return { booked: last ?? 0 };
  }, { minOrphanedMs: 5000, signal });
  const ran: number = await worker.run({ maxTurns: 10, untilIdle: true });
  worker.stop();
  return drained.length + fromRequest.length + ran;
}
