//! PDF parsing in a child process, so a hostile file can never touch the
//! server.
//!
//! `pdf-extract` (on `lopdf`) recurses on a document's structure and
//! decompresses its streams without bounds: a 786-byte PDF whose drawing
//! calls itself overflowed the stack and aborted the whole server (an abort
//! no `catch_unwind` stops), two 8.6 KB files held both parse slots at
//! 100 % CPU forever, and a 917 KB FlateDecode bomb took RSS to 1.9 GB. In
//! a thread none of that can be stopped. In a child process it can:
//!
//! - the child limits itself before reading a byte: address space
//!   [`MAX_PARSE_MEMORY`], CPU time [`MAX_PARSE_TIME`], no core file;
//! - the parent kills it at [`MAX_PARSE_TIME`] of wall time (a child stuck
//!   without using CPU), and reads at most [`MAX_PARSED_TEXT_BYTES`] of its
//!   text;
//! - a child that died (a stack overflow, a limit, a kill) is the file's
//!   fault: the upload is refused `invalid`, and its parse slot is free the
//!   moment the child is gone.
//!
//! The binary opts in with [`use_parser_process`] at startup (`agentgate
//! serve` does, naming itself and [`PARSE_SUBCOMMAND`], which runs
//! [`child_main`]); a library user who does not parses in a thread, as
//! before.

use std::path::PathBuf;
use std::process::{ExitCode, Stdio};
use std::sync::OnceLock;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::limits::{MAX_DOCUMENT_BYTES, MAX_PARSED_TEXT_BYTES, MAX_PARSE_MEMORY, MAX_PARSE_TIME};
use crate::{IngestError, MediaType};

/// The hidden subcommand of the `agentgate` binary that runs
/// [`child_main`].
pub const PARSE_SUBCOMMAND: &str = "__parse-pdf";

/// Exit code of a child that refused the file (its reason on stderr).
const REFUSED: u8 = 2;

/// The most of a child's stderr kept for the refusal's message.
const MAX_REASON_BYTES: u64 = 4 * 1024;

/// The program (and its arguments) a PDF is parsed by.
#[derive(Clone, Debug)]
pub struct ParserProcess {
    program: PathBuf,
    args: Vec<String>,
}

impl ParserProcess {
    /// `program args…`, which reads a PDF on stdin as [`child_main`] does.
    pub fn new(program: PathBuf, args: Vec<String>) -> Self {
        Self { program, args }
    }

    /// This executable with [`PARSE_SUBCOMMAND`]: for a binary whose `main`
    /// runs [`child_main`] when given it.
    ///
    /// # Errors
    /// When the running executable's path cannot be read.
    pub fn this_executable() -> std::io::Result<Self> {
        Ok(Self::new(
            std::env::current_exe()?,
            vec![PARSE_SUBCOMMAND.to_owned()],
        ))
    }
}

static PARSER: OnceLock<ParserProcess> = OnceLock::new();

/// Parses every PDF of this process in `parser`'s child processes from now
/// on. The first call wins: it is the binary's choice, made once at
/// startup.
pub fn use_parser_process(parser: ParserProcess) {
    let _ = PARSER.set(parser);
}

/// The parser process in use, if the binary chose one.
pub(crate) fn parser_process() -> Option<&'static ParserProcess> {
    PARSER.get()
}

/// A PDF's text from a child process of `parser` (see the module
/// documentation).
///
/// # Errors
/// `invalid` when the child refused the file, died, ran past
/// [`MAX_PARSE_TIME`] or wrote more than [`MAX_PARSED_TEXT_BYTES`];
/// `corrupt` when the child could not be started.
pub(crate) async fn parse_pdf(
    parser: &ParserProcess,
    content: &[u8],
) -> Result<String, IngestError> {
    let bad = |why: String| IngestError::Invalid(format!("the PDF cannot be read: {why}"));
    let mut child = tokio::process::Command::new(&parser.program)
        .args(&parser.args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| {
            IngestError::Corrupt(format!(
                "the PDF parser {} could not be started: {e}",
                parser.program.display()
            ))
        })?;
    let (Some(mut stdin), Some(stdout), Some(stderr)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Err(IngestError::Corrupt(
            "the parser's pipes are missing".into(),
        ));
    };
    let input = content.to_vec();
    let feeding = tokio::spawn(async move {
        // A child that dies early closes its stdin: not this side's error.
        let _ = stdin.write_all(&input).await;
    });
    let limit = u64::try_from(MAX_PARSED_TEXT_BYTES).unwrap_or(u64::MAX);
    let run = async {
        let mut text = Vec::new();
        let mut reason = Vec::new();
        let (mut stdout, mut stderr) = (stdout.take(limit + 1), stderr.take(MAX_REASON_BYTES));
        let (read, _) = tokio::join!(
            stdout.read_to_end(&mut text),
            stderr.read_to_end(&mut reason),
        );
        read.map_err(|e| bad(format!("reading its text failed: {e}")))?;
        if text.len() as u64 > limit {
            return Err(IngestError::Invalid(format!(
                "the PDF's text is over {MAX_PARSED_TEXT_BYTES} bytes"
            )));
        }
        let status = child
            .wait()
            .await
            .map_err(|e| IngestError::Corrupt(format!("waiting for the parser failed: {e}")))?;
        match status.code() {
            Some(0) => String::from_utf8(text).map_err(|e| bad(e.to_string())),
            Some(code) if code == i32::from(REFUSED) => Err(IngestError::Invalid(
                String::from_utf8_lossy(&reason).trim().to_owned(),
            )),
            _ => Err(bad(format!(
                "its parser died ({status}): a structure it cannot handle, or over its \
                 limits of {} MiB and {MAX_PARSE_TIME:?}",
                MAX_PARSE_MEMORY / (1024 * 1024)
            ))),
        }
    };
    let answer = tokio::time::timeout(MAX_PARSE_TIME, run)
        .await
        .unwrap_or_else(|_| {
            Err(IngestError::Invalid(format!(
                "parsing the document took longer than {MAX_PARSE_TIME:?}"
            )))
        });
    // Dropping `child` (kill_on_drop) kills a child still running.
    feeding.abort();
    answer
}

/// The child's side: limits itself, reads a PDF of at most
/// [`MAX_DOCUMENT_BYTES`] on stdin, writes its text on stdout (exit 0), or
/// its reason for refusing it on stderr (exit 2). Call it before starting
/// any runtime or thread, so the address-space limit counts the parse.
pub fn child_main() -> ExitCode {
    use std::io::{Read as _, Write as _};
    let memory = u64::try_from(MAX_PARSE_MEMORY).unwrap_or(u64::MAX);
    let cpu = MAX_PARSE_TIME.as_secs();
    let limited = rlimit::setrlimit(rlimit::Resource::AS, memory, memory)
        .and_then(|()| rlimit::setrlimit(rlimit::Resource::CPU, cpu, cpu))
        .and_then(|()| rlimit::setrlimit(rlimit::Resource::CORE, 0, 0));
    if let Err(error) = limited {
        eprintln!("the PDF parser could not limit itself: {error}");
        return ExitCode::from(3);
    }
    let mut content = Vec::new();
    let limit = u64::try_from(MAX_DOCUMENT_BYTES).unwrap_or(u64::MAX);
    if let Err(error) = std::io::stdin().take(limit + 1).read_to_end(&mut content) {
        eprintln!("the PDF could not be read: {error}");
        return ExitCode::from(REFUSED);
    }
    if content.len() as u64 > limit {
        eprintln!("the document is over {MAX_DOCUMENT_BYTES} bytes");
        return ExitCode::from(REFUSED);
    }
    match crate::chunk::parse(&content, MediaType::Pdf) {
        Ok(text) => match std::io::stdout().lock().write_all(text.as_bytes()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(_) => ExitCode::from(3),
        },
        Err(IngestError::Invalid(reason)) => {
            eprintln!("{reason}");
            ExitCode::from(REFUSED)
        }
        Err(other) => {
            eprintln!("{other}");
            ExitCode::from(3)
        }
    }
}
