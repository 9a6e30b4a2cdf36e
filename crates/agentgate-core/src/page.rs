//! Pages of a turn's tool executions, walked by a keyset cursor.
//!
//! Executions are ordered by their place among the turn's claims (the
//! store numbers each new execution after the ones it counts, unique per
//! turn), then their id; a cursor names the last execution of a page, and the next page is
//! the executions after it in that order (a keyset query, never `OFFSET`).
//! A page carries at most its limit of executions and at most
//! [`MAX_EXECUTION_PAGE_BYTES`] of results and errors, and never fewer than
//! one execution when there is one after the cursor.

use std::fmt;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::ids::ExecutionId;
use crate::limits::{
    DEFAULT_EXECUTION_PAGE, MAX_EXECUTIONS_PER_TURN, MAX_EXECUTION_PAGE, MAX_EXECUTION_PAGE_BYTES,
};
use crate::model::ExecutionView;

/// Where a page starts: just after the execution with this ordering key.
/// On the wire it is opaque text, `<claim_seq>.<execution_id>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutionCursor {
    /// The execution's place among its turn's claims, from 1.
    pub claim_seq: i64,
    /// The execution.
    pub execution_id: ExecutionId,
}

impl ExecutionCursor {
    /// Parses a cursor a caller sent back.
    ///
    /// # Errors
    /// `invalid_request` when it is not one this engine handed out.
    pub fn parse(text: &str) -> Result<Self> {
        let bad = || Error::invalid("after is not a cursor this server handed out");
        let (seq, id) = text.split_once('.').ok_or_else(bad)?;
        if seq.is_empty() || seq.len() > 18 || !seq.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let claim_seq: i64 = seq.parse().map_err(|_| bad())?;
        // No execution is numbered past the turn's bound. A larger number is
        // most likely a cursor of an older release (`<created_at_ms>.<id>`),
        // which read as a claim number would silently end the walk early.
        if claim_seq > i64::from(MAX_EXECUTIONS_PER_TURN) {
            return Err(bad());
        }
        if !id.starts_with("exec_") {
            return Err(bad());
        }
        let execution_id = ExecutionId::new(id).map_err(|_| bad())?;
        Ok(Self {
            claim_seq,
            execution_id,
        })
    }
}

impl fmt::Display for ExecutionCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.claim_seq, self.execution_id.as_str())
    }
}

/// Which page of a turn's executions to read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutionPageRequest {
    /// Start after this execution; `None` for the first page.
    pub after: Option<ExecutionCursor>,
    /// Most executions on the page, `1..=`[`MAX_EXECUTION_PAGE`].
    limit: u32,
}

impl Default for ExecutionPageRequest {
    fn default() -> Self {
        Self {
            after: None,
            limit: DEFAULT_EXECUTION_PAGE,
        }
    }
}

impl ExecutionPageRequest {
    /// A page request; `limit` `None` is [`DEFAULT_EXECUTION_PAGE`].
    ///
    /// # Errors
    /// `invalid_request` for a limit outside `1..=`[`MAX_EXECUTION_PAGE`].
    pub fn new(after: Option<ExecutionCursor>, limit: Option<u32>) -> Result<Self> {
        let limit = limit.unwrap_or(DEFAULT_EXECUTION_PAGE);
        if limit == 0 || limit > MAX_EXECUTION_PAGE {
            return Err(Error::invalid(format!(
                "limit is {limit}, allowed 1..={MAX_EXECUTION_PAGE}"
            )));
        }
        Ok(Self { after, limit })
    }

    /// The first page at the largest size.
    pub fn largest() -> Self {
        Self {
            after: None,
            limit: MAX_EXECUTION_PAGE,
        }
    }

    /// The same size, after `cursor`.
    #[must_use]
    pub fn after(&self, cursor: ExecutionCursor) -> Self {
        Self {
            after: Some(cursor),
            limit: self.limit,
        }
    }

    /// Most executions on the page.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Rows a store fetches: one more than the limit, to learn whether a
    /// next page exists.
    pub fn fetch(&self) -> u32 {
        self.limit + 1
    }
}

/// One page of a turn's executions, oldest first.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExecutionPage {
    /// The executions.
    pub executions: Vec<ExecutionView>,
    /// Where the next page starts; `None` on the last page.
    pub next: Option<ExecutionCursor>,
}

/// How many of the candidate rows (in page order, each with the bytes of
/// its stored result and error) a page takes: at most the limit, at most
/// [`MAX_EXECUTION_PAGE_BYTES`] in all, and at least one when there is one.
pub fn page_rows(bytes: &[u64], request: &ExecutionPageRequest) -> usize {
    let budget = u64::try_from(MAX_EXECUTION_PAGE_BYTES).unwrap_or(u64::MAX);
    let mut total = 0u64;
    let mut taken = 0usize;
    for &size in bytes.iter().take(request.limit() as usize) {
        total = total.saturating_add(size);
        if taken > 0 && total > budget {
            break;
        }
        taken += 1;
    }
    taken
}

fn json_bytes(value: Option<&Value>) -> u64 {
    value.map_or(0, |v| {
        u64::try_from(serde_json::to_vec(v).map_or(0, |b| b.len())).unwrap_or(u64::MAX)
    })
}

/// Plans a page from the candidate rows a store read in page order (at
/// most [`ExecutionPageRequest::fetch`] of them): each row's execution id,
/// claim number and stored bytes of result and error. Returns the ordering
/// keys of the rows the page takes and whether rows follow them.
///
/// # Errors
/// `store_unavailable` (corrupt) for a stored id that is not an execution
/// id or a negative size.
pub fn plan(
    candidates: Vec<(String, i64, i64)>,
    request: &ExecutionPageRequest,
) -> Result<(Vec<ExecutionCursor>, bool)> {
    let sizes = candidates
        .iter()
        .map(|(_, _, bytes)| {
            u64::try_from(*bytes)
                .map_err(|_| Error::corrupt("a stored execution has a negative size"))
        })
        .collect::<Result<Vec<u64>>>()?;
    let take = page_rows(&sizes, request);
    let more = candidates.len() > take;
    let keys = candidates
        .into_iter()
        .take(take)
        .map(|(id, claim_seq, _)| {
            Ok(ExecutionCursor {
                claim_seq,
                execution_id: ExecutionId::new(id).map_err(Error::corrupt)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((keys, more))
}

/// Builds a page from the full rows a store read for the keys `planned`
/// chose (`keys` are the planned rows' ordering keys, in order; `more` says
/// whether rows follow them). Rows whose results completed between the two
/// reads may have grown: the page is cut again by bytes, so the bound holds.
///
/// # Errors
/// `store_unavailable` (corrupt) when the rows do not match their keys.
pub fn assemble(
    rows: Vec<ExecutionView>,
    keys: &[ExecutionCursor],
    more: bool,
    request: &ExecutionPageRequest,
) -> Result<ExecutionPage> {
    let sizes: Vec<u64> = rows
        .iter()
        .map(|r| json_bytes(r.result.as_ref()) + json_bytes(r.error.as_ref()))
        .collect();
    let keep = page_rows(&sizes, request);
    let cut = keep < rows.len();
    let mut executions = rows;
    executions.truncate(keep);
    let next = match executions.last() {
        Some(last) if more || cut || keys.len() > executions.len() => {
            let key = keys
                .iter()
                .find(|k| k.execution_id == last.execution_id)
                .ok_or_else(|| Error::corrupt("a page row has no planned key"))?;
            Some(key.clone())
        }
        _ => None,
    };
    Ok(ExecutionPage { executions, next })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn cursors_round_trip_and_bad_ones_are_refused() {
        let cursor = ExecutionCursor {
            claim_seq: 17,
            execution_id: ExecutionId::new("exec_00ff").unwrap(),
        };
        assert_eq!(ExecutionCursor::parse(&cursor.to_string()).unwrap(), cursor);
        // The last number a turn can hand out is a cursor; the OpenAPI
        // pattern of `after` (agentgate-server's dto.rs) states the same bound.
        assert_eq!(MAX_EXECUTIONS_PER_TURN, 1_000);
        assert!(ExecutionCursor::parse("1000.exec_1").is_ok());
        assert!(ExecutionCursor::parse("0.exec_1").is_ok());
        for bad in [
            "",
            ".",
            "1.",
            ".exec_1",
            "x.exec_1",
            "-1.exec_1",
            "1.turn_1",
            "1exec_1",
            "99999999999999999999.exec_1",
            "1001.exec_1",
            "1764600000000.exec_1",
        ] {
            let error = ExecutionCursor::parse(bad).unwrap_err();
            assert_eq!(error.kind().code(), "invalid_request", "{bad:?}");
        }
    }

    #[test]
    fn a_plan_keeps_the_keys_the_page_takes_and_refuses_corrupt_rows() {
        let request = ExecutionPageRequest::new(None, Some(2)).unwrap();
        let row = |id: &str, at: i64, bytes: i64| (id.to_owned(), at, bytes);
        let (keys, more) = plan(
            vec![
                row("exec_a", 1, 10),
                row("exec_b", 1, 10),
                row("exec_c", 2, 10),
            ],
            &request,
        )
        .unwrap();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[1].execution_id.as_str(), "exec_b");
        assert!(more, "a third row follows");
        let (keys, more) = plan(vec![row("exec_a", 1, 10)], &request).unwrap();
        assert_eq!((keys.len(), more), (1, false));
        assert!(
            plan(vec![row("exec_a", 1, -1)], &request).is_err(),
            "a negative size is corrupt"
        );
        assert!(
            plan(vec![row("", 1, 1)], &request).is_err(),
            "an empty id is corrupt"
        );
    }

    #[test]
    fn limits_are_checked() {
        assert_eq!(
            ExecutionPageRequest::new(None, None).unwrap().limit(),
            DEFAULT_EXECUTION_PAGE
        );
        assert!(ExecutionPageRequest::new(None, Some(0)).is_err());
        assert!(ExecutionPageRequest::new(None, Some(MAX_EXECUTION_PAGE + 1)).is_err());
        assert!(ExecutionPageRequest::new(None, Some(MAX_EXECUTION_PAGE)).is_ok());
    }

    #[test]
    fn a_page_stops_at_its_limit_and_its_bytes_but_takes_one() {
        let request = ExecutionPageRequest::new(None, Some(3)).unwrap();
        assert_eq!(page_rows(&[1, 1, 1, 1], &request), 3);
        assert_eq!(page_rows(&[], &request), 0);
        let mib = 1024 * 1024;
        assert_eq!(
            page_rows(&[mib, mib, mib, mib, mib], &ExecutionPageRequest::default()),
            4
        );
        assert_eq!(page_rows(&[8 * mib, 1], &request), 1, "one row always fits");
        assert_eq!(page_rows(&[3 * mib, 2 * mib], &request), 1);
    }
}
