// A PDF written by hand for the tests: each paragraph one line of Helvetica
// text, `perPage` paragraphs to a page, and a cross-reference table of the
// objects' byte offsets. The server's parser (pdf-extract) reads it like
// any PDF a person would drop.

/** `paragraphs` (ASCII strings) as the bytes of a PDF. */
export function pdf(paragraphs, perPage = 30) {
  const pages = [];
  for (let i = 0; i < paragraphs.length; i += perPage) pages.push(paragraphs.slice(i, i + perPage));
  const escape = (line) => line.replace(/[\\()]/g, (c) => `\\${c}`);
  const objects = [
    "<< /Type /Catalog /Pages 2 0 R >>",
    `<< /Type /Pages /Kids [${pages.map((_, i) => `${4 + 2 * i} 0 R`).join(" ")}] /Count ${pages.length} >>`,
    "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>",
  ];
  pages.forEach((page, i) => {
    const content = ["BT /F1 9 Tf 14 TL 40 800 Td", ...page.map((p) => `(${escape(p)}) Tj T* T*`), "ET"].join("\n");
    objects.push(`<< /Type /Page /Parent 2 0 R /MediaBox [0 0 595 842] /Resources << /Font << /F1 3 0 R >> >> /Contents ${5 + 2 * i} 0 R >>`);
    objects.push(`<< /Length ${Buffer.byteLength(content, "latin1")} >>\nstream\n${content}\nendstream`);
  });
  let out = "%PDF-1.4\n";
  const offsets = objects.map((object, i) => {
    const at = Buffer.byteLength(out, "latin1");
    out += `${i + 1} 0 obj\n${object}\nendobj\n`;
    return at;
  });
  const xref = Buffer.byteLength(out, "latin1");
  out += `xref\n0 ${objects.length + 1}\n0000000000 65535 f \n`;
  for (const at of offsets) out += `${String(at).padStart(10, "0")} 00000 n \n`;
  out += `trailer\n<< /Size ${objects.length + 1} /Root 1 0 R >>\nstartxref\n${xref}\n%%EOF\n`;
  return Buffer.from(out, "latin1");
}
