//! From an upload's bytes to its chunks: parsing (plain text, Markdown),
//! cutting into chunks, and the ids that make every write repeatable.
//!
//! Everything here is a pure function of the content, so a takeover that
//! parses the same bytes again gets the same chunks, in the same order,
//! with the same ids: re-running a batch upserts rows that already exist.

use sha2::{Digest, Sha256};

use crate::limits::{CHUNK_CHARS, MAX_CHUNKS, MAX_PDF_PAGES};
use crate::IngestError;

/// What an upload's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MediaType {
    /// UTF-8 text.
    Text,
    /// CommonMark: the markup is dropped, the text kept.
    Markdown,
    /// PDF: the text of its pages, in page order.
    Pdf,
}

impl MediaType {
    /// The media type of an upload: a PDF by its magic bytes (`%PDF-`) or
    /// its name, Markdown by `.md`/`.markdown`, anything else text.
    pub fn detect(name: &str, content: &[u8]) -> Self {
        let lower = name.to_ascii_lowercase();
        if content.starts_with(b"%PDF-") || lower.ends_with(".pdf") {
            Self::Pdf
        } else if lower.ends_with(".md") || lower.ends_with(".markdown") {
            Self::Markdown
        } else {
            Self::Text
        }
    }
}

/// One chunk of a document version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Its position in the version, from 0.
    pub index: usize,
    /// Its text.
    pub text: String,
    /// `sha256(text)`, hex.
    pub hash: String,
}

/// `sha256(bytes)`, hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The id of a chunk: derived from the document, the version, the position
/// and the chunk's own hash, so the same chunk of the same version always
/// has the same id and an upsert by id never adds a copy.
pub fn chunk_id(document_id: &str, version: &str, index: usize, hash: &str) -> String {
    let key = format!("{document_id}\u{0}{version}\u{0}{index}\u{0}{hash}");
    format!("chk_{}", &sha256_hex(key.as_bytes())[..32])
}

/// The document id of a first upload: derived from the tenant and the
/// content, so three uploads of one file name one document.
pub fn document_id(tenant: &str, content_sha: &str) -> String {
    let key = format!("{tenant}\u{0}{content_sha}");
    format!("doc_{}", &sha256_hex(key.as_bytes())[..24])
}

/// The document's text.
///
/// A PDF is parsed by `pdf-extract` (on `lopdf`), Markdown by
/// `pulldown-cmark`. Parsing a PDF is CPU work: an async caller runs it
/// through [`crate::Ingestor`], which bounds its time and its concurrency.
///
/// # Errors
/// `invalid` when the bytes are not UTF-8 (text, Markdown), not a readable
/// unencrypted PDF of at most [`MAX_PDF_PAGES`] pages, or hold no text.
pub fn parse(content: &[u8], media_type: MediaType) -> Result<String, IngestError> {
    let text = match media_type {
        MediaType::Text => utf8(content)?.to_owned(),
        MediaType::Markdown => markdown_text(utf8(content)?),
        MediaType::Pdf => pdf_text(content)?,
    };
    if text.trim().is_empty() {
        return Err(IngestError::Invalid("the document holds no text".into()));
    }
    Ok(text)
}

fn utf8(content: &[u8]) -> Result<&str, IngestError> {
    std::str::from_utf8(content)
        .map_err(|e| IngestError::Invalid(format!("the document is not UTF-8: {e}")))
}

/// A PDF's text, page after page, a blank line between pages so a page
/// break is a paragraph break. `pdf-extract` can panic on a malformed
/// file; that is the file's fault, so it is refused like any bad input.
fn pdf_text(content: &[u8]) -> Result<String, IngestError> {
    let bad = |why: String| IngestError::Invalid(format!("the PDF cannot be read: {why}"));
    let extract = || -> Result<String, IngestError> {
        let doc = pdf_extract::Document::load_mem(content).map_err(|e| bad(e.to_string()))?;
        if doc.is_encrypted() {
            return Err(bad("it is encrypted".into()));
        }
        let pages = doc.get_pages().len();
        if pages > MAX_PDF_PAGES {
            return Err(IngestError::Invalid(format!(
                "the PDF has {pages} pages; at most {MAX_PDF_PAGES}"
            )));
        }
        let mut text = String::new();
        for page in 1..=u32::try_from(pages).map_err(|e| bad(e.to_string()))? {
            let mut out = pdf_extract::PlainTextOutput::new(&mut text);
            pdf_extract::output_doc_page(&doc, &mut out, page).map_err(|e| bad(e.to_string()))?;
            text.push_str("\n\n");
        }
        Ok(text)
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(extract))
        .unwrap_or_else(|_| Err(bad("the parser gave up on its structure".into())))
}

/// Markdown's text without its markup, as `pulldown-cmark` reads it: a
/// block (paragraph, heading, code block, list, quote, table) ends with a
/// blank line so the chunker sees it as a paragraph, a list item or a table
/// row with a line break; link targets, images' URLs and raw HTML dropped.
fn markdown_text(markdown: &str) -> String {
    use pulldown_cmark::{Event, Options, Parser, TagEnd};
    let mut out = String::with_capacity(markdown.len());
    let options = Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH;
    for event in Parser::new_ext(markdown, options) {
        match event {
            Event::Text(text) | Event::Code(text) => out.push_str(&text),
            Event::SoftBreak | Event::HardBreak => out.push('\n'),
            Event::End(TagEnd::Item | TagEnd::TableRow | TagEnd::TableHead) => {
                end_line(&mut out, "\n");
            }
            Event::End(TagEnd::TableCell) => out.push(' '),
            Event::End(
                TagEnd::Paragraph
                | TagEnd::Heading(_)
                | TagEnd::CodeBlock
                | TagEnd::List(_)
                | TagEnd::BlockQuote(_)
                | TagEnd::Table,
            ) => end_line(&mut out, "\n\n"),
            _ => {}
        }
    }
    out
}

/// Ends the text's last line with `ending`, unless it already ends so.
fn end_line(out: &mut String, ending: &str) {
    let trimmed = out.trim_end_matches('\n').len();
    let have = out.len() - trimmed;
    if have < ending.len() {
        out.truncate(trimmed);
        out.push_str(ending);
    }
}

/// Cuts the text into chunks of about [`CHUNK_CHARS`] characters, at
/// paragraph boundaries where it can (blank lines), at a character boundary
/// inside a longer paragraph.
///
/// # Errors
/// `invalid` for more than [`MAX_CHUNKS`] chunks.
pub fn chunks(text: &str) -> Result<Vec<Chunk>, IngestError> {
    let mut pieces: Vec<String> = Vec::new();
    let mut current = String::new();
    for paragraph in text.split("\n\n").map(str::trim).filter(|p| !p.is_empty()) {
        let paragraph: String = paragraph.split_whitespace().collect::<Vec<_>>().join(" ");
        for part in split_chars(&paragraph, CHUNK_CHARS) {
            let fits = current.chars().count() + 1 + part.chars().count() <= CHUNK_CHARS;
            if !current.is_empty() && !fits {
                pieces.push(std::mem::take(&mut current));
            }
            if !current.is_empty() {
                current.push('\n');
            }
            current.push_str(&part);
        }
    }
    if !current.is_empty() {
        pieces.push(current);
    }
    if pieces.len() > MAX_CHUNKS {
        return Err(IngestError::Invalid(format!(
            "the document makes {} chunks; at most {MAX_CHUNKS}",
            pieces.len()
        )));
    }
    Ok(pieces
        .into_iter()
        .enumerate()
        .map(|(index, text)| Chunk {
            index,
            hash: sha256_hex(text.as_bytes()),
            text,
        })
        .collect())
}

/// `text` in pieces of at most `max` characters.
fn split_chars(text: &str, max: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(max).map(|c| c.iter().collect()).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn chunks_are_a_pure_function_of_the_text() {
        let text = (0..40)
            .map(|i| format!("Paragraph {i}: {}", "words ".repeat(30)))
            .collect::<Vec<_>>()
            .join("\n\n");
        let first = chunks(&text).unwrap();
        assert_eq!(first, chunks(&text).unwrap());
        assert!(first.len() > 1, "{}", first.len());
        assert!(first.iter().all(|c| c.text.chars().count() <= CHUNK_CHARS));
        let ids: std::collections::HashSet<_> = first
            .iter()
            .map(|c| chunk_id("doc", "v1", c.index, &c.hash))
            .collect();
        assert_eq!(ids.len(), first.len(), "ids are distinct");
    }

    #[test]
    fn markdown_keeps_the_text_and_drops_the_markup() {
        let text = parse(
            b"# Refunds\n\n- Keep **every** receipt\n- See [the policy](https://x.test/p)\n",
            MediaType::Markdown,
        )
        .unwrap();
        assert_eq!(text, "Refunds\n\nKeep every receipt\nSee the policy\n\n");
        let text = parse(b"a [b] c [d](e) and [[[[", MediaType::Markdown).unwrap();
        assert_eq!(text, "a [b] c d and [[[[\n\n");
        let text = parse(
            b"```\nlet x = 1;\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n<b>raw</b> tail\n",
            MediaType::Markdown,
        )
        .unwrap();
        assert_eq!(text, "let x = 1;\n\na b \n1 2 \n\nraw tail\n\n");
    }

    #[test]
    fn bad_input_is_refused() {
        assert!(parse(&[0xff, 0xfe], MediaType::Text).is_err());
        assert!(parse(b"  \n ", MediaType::Text).is_err());
        assert!(parse(b"%PDF-1.4 not really", MediaType::Pdf).is_err());
        assert!(parse(b"", MediaType::Pdf).is_err());
    }

    #[test]
    fn a_pdf_is_detected_by_its_bytes_or_its_name() {
        assert_eq!(MediaType::detect("x.bin", b"%PDF-1.7\n"), MediaType::Pdf);
        assert_eq!(MediaType::detect("X.PDF", b""), MediaType::Pdf);
        assert_eq!(MediaType::detect("a.Md", b"# t"), MediaType::Markdown);
        assert_eq!(MediaType::detect("a.txt", b"t"), MediaType::Text);
    }
}
