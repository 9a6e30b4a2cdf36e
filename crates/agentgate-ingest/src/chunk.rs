//! From an upload's bytes to its chunks: parsing (plain text, Markdown),
//! cutting into chunks, and the ids that make every write repeatable.
//!
//! Everything here is a pure function of the content, so a takeover that
//! parses the same bytes again gets the same chunks, in the same order,
//! with the same ids: re-running a batch upserts rows that already exist.

use sha2::{Digest, Sha256};

use crate::limits::{CHUNK_CHARS, MAX_CHUNKS};
use crate::IngestError;

/// What an upload's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MediaType {
    /// UTF-8 text.
    Text,
    /// CommonMark: the markup is dropped, the text kept.
    Markdown,
}

impl MediaType {
    /// The media type a file name implies: `.md`/`.markdown` is Markdown,
    /// anything else text.
    pub fn from_name(name: &str) -> Self {
        let lower = name.to_ascii_lowercase();
        if lower.ends_with(".md") || lower.ends_with(".markdown") {
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
/// # Errors
/// `invalid` when the bytes are not UTF-8 or hold no text.
pub fn parse(content: &[u8], media_type: MediaType) -> Result<String, IngestError> {
    let text = std::str::from_utf8(content)
        .map_err(|e| IngestError::Invalid(format!("the document is not UTF-8: {e}")))?;
    let text = match media_type {
        MediaType::Text => text.to_owned(),
        MediaType::Markdown => markdown_text(text),
    };
    if text.trim().is_empty() {
        return Err(IngestError::Invalid("the document holds no text".into()));
    }
    Ok(text)
}

/// Markdown's text without its markup: heading and list markers, emphasis,
/// code fences and link targets dropped, line structure kept.
fn markdown_text(markdown: &str) -> String {
    let mut out = String::with_capacity(markdown.len());
    for line in markdown.lines() {
        let line = line.trim_start();
        if line.starts_with("```") || line.starts_with("~~~") {
            continue;
        }
        let line = line.trim_start_matches('#').trim_start_matches('>');
        let line = line
            .strip_prefix("- ")
            .or_else(|| line.strip_prefix("* "))
            .or_else(|| line.strip_prefix("+ "))
            .unwrap_or(line);
        out.push_str(&strip_inline(line.trim()));
        out.push('\n');
    }
    out
}

/// The longest link text and target [`strip_inline`] looks for, so a line
/// of unclosed brackets costs linear time.
const MAX_LINK_CHARS: usize = 512;

/// Drops inline markup: `**`, `__`, `*`, `_`, `` ` ``, and `[text](target)`
/// becomes `text`.
fn strip_inline(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(c) = rest.chars().next() {
        if c == '[' {
            if let Some((text, after)) = link(rest) {
                out.push_str(&strip_inline(text));
                rest = after;
                continue;
            }
        }
        if !matches!(c, '*' | '_' | '`') {
            out.push(c);
        }
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// `[text](target)` at the start of `s`: the text and what follows the
/// link. The text's own `]` closes it; both parts are bounded.
fn link(s: &str) -> Option<(&str, &str)> {
    let window = |from: &str| -> usize {
        from.char_indices()
            .nth(MAX_LINK_CHARS)
            .map_or(from.len(), |(i, _)| i)
    };
    let body = &s[1..];
    let close = body[..window(body)].find(']')?;
    let after = body[close + 1..].strip_prefix('(')?;
    let end = after[..window(after)].find(')')?;
    Some((&body[..close], &after[end + 1..]))
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
        assert_eq!(text, "Refunds\n\nKeep every receipt\nSee the policy\n");
        let text = parse(b"a [b] c [d](e) and [[[[", MediaType::Markdown).unwrap();
        assert_eq!(text, "a [b] c d and [[[[\n");
    }

    #[test]
    fn bad_input_is_refused() {
        assert!(parse(&[0xff, 0xfe], MediaType::Text).is_err());
        assert!(parse(b"  \n ", MediaType::Text).is_err());
    }
}
