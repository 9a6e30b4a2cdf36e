//! A turn's tool executions are read in pages (keyset cursor, bounded rows
//! and bytes): walking the pages yields every execution exactly once, in
//! claim order, whatever the page size.

use std::collections::BTreeMap;

use agentgate::page::{ExecutionCursor, ExecutionPageRequest};
use agentgate::{ErrorKind, ExecutionId, ToolStep};
use agentgate_core::limits::{
    DEFAULT_EXECUTION_PAGE, MAX_EXECUTION_PAGE, MAX_EXECUTION_PAGE_BYTES,
};
use agentgate_core::model::ExecutionView;
use agentgate_core::store::{all_executions, Store};
use serde_json::json;

use super::{config, must_start, report};
use crate::Target;

/// Executions in the turn: more than two default pages.
const EXECUTIONS: usize = 2 * DEFAULT_EXECUTION_PAGE as usize + 20;

/// Characters of each result: 50 of them pass the page byte limit, so the
/// default page is cut by bytes, not by its row limit.
const RESULT_CHARS: usize = 100_000;

fn bytes(view: &ExecutionView) -> usize {
    [view.result.as_ref(), view.error.as_ref()]
        .into_iter()
        .flatten()
        .map(|v| serde_json::to_vec(v).expect("json").len())
        .sum()
}

/// Walks every page at `limit`; checks each page's bounds and that a page
/// is cut only where the next execution would pass a bound. Returns the ids
/// in walk order and the page count.
async fn walk(
    store: &dyn Store,
    turn: &agentgate::TurnId,
    limit: u32,
) -> (Vec<ExecutionId>, usize) {
    let mut request = ExecutionPageRequest::new(None, Some(limit)).expect("limit");
    let mut ids = Vec::new();
    let mut pages = 0;
    loop {
        let page = store.executions(turn, &request).await.expect("page");
        pages += 1;
        assert!(pages <= EXECUTIONS + 1, "the walk does not end");
        let rows = page.executions.len();
        let size: usize = page.executions.iter().map(bytes).sum();
        assert!(
            rows <= limit as usize,
            "page of {rows} rows over limit {limit}"
        );
        assert!(
            size <= MAX_EXECUTION_PAGE_BYTES,
            "page of {size} bytes over {MAX_EXECUTION_PAGE_BYTES}"
        );
        ids.extend(page.executions.iter().map(|e| e.execution_id.clone()));
        let Some(next) = page.next else { break };
        assert!(rows > 0, "a page with a next carries an execution");
        assert_eq!(
            Some(&next.execution_id),
            ids.last(),
            "the cursor names the page's last execution"
        );
        if rows < limit as usize {
            // Cut by bytes: the next execution would have passed the limit.
            let following = store
                .executions(
                    turn,
                    &ExecutionPageRequest::new(Some(next.clone()), Some(1)).expect("1"),
                )
                .await
                .expect("page");
            let first = following
                .executions
                .first()
                .expect("a next execution exists");
            assert!(
                size + bytes(first) > MAX_EXECUTION_PAGE_BYTES,
                "a page of {rows} rows and {size} bytes stopped early"
            );
        }
        request = request.after(next);
    }
    (ids, pages)
}

/// A turn records 120 executions claimed back to back (many in one
/// store-clock millisecond), each with a 100 KB result. Walking its pages at the default size (cut by
/// the 4 MiB byte limit), at 7 (cut by rows) and at the largest size yields
/// every execution exactly once, in claim order; every page is within its
/// row and byte limits and is cut only where the next execution would pass
/// one. A cursor after the last execution gives an empty last page; an
/// out-of-range page size is `invalid_request`.
pub async fn execution_pages_walk_every_execution_once(target: &Target) {
    let gate = target.gate(config()).await;
    let turn = must_start(&gate, "pages-user", "pages-session", "r").await;
    let filler = "x".repeat(RESULT_CHARS);
    let mut claimed = Vec::new();
    for i in 0..EXECUTIONS {
        // No pause between claims: many share a store-clock millisecond,
        // and the store's order must still be claim order.
        match turn.tool("lookup", &json!({"i": i})).await.expect("claim") {
            ToolStep::Execute(execution) => {
                claimed.push(execution.id().clone());
                execution
                    .complete(&json!({"i": i, "filler": filler}))
                    .await
                    .expect("complete");
            }
            ToolStep::Cached(_) => panic!("a fresh call is not cached"),
        }
    }
    let store = gate.store().as_ref();
    let mut counts = BTreeMap::new();
    for limit in [DEFAULT_EXECUTION_PAGE, 7, MAX_EXECUTION_PAGE] {
        let (ids, pages) = walk(store, turn.id(), limit).await;
        assert_eq!(
            ids, claimed,
            "limit {limit}: every execution once, in order"
        );
        counts.insert(format!("pages_at_limit_{limit}"), pages);
    }
    let whole = all_executions(store, turn.id()).await.expect("all");
    assert_eq!(
        whole
            .iter()
            .map(|e| e.execution_id.clone())
            .collect::<Vec<_>>(),
        claimed
    );
    let last = whole.last().expect("executions");
    let probe = store
        .executions(
            turn.id(),
            &ExecutionPageRequest::new(None, Some(MAX_EXECUTION_PAGE)).expect("limit"),
        )
        .await
        .expect("page");
    assert!(
        probe.next.is_some(),
        "120 results of 100 KB do not fit one page"
    );
    let past_end = ExecutionCursor {
        claim_seq: i64::MAX,
        execution_id: last.execution_id.clone(),
    };
    let empty = store
        .executions(turn.id(), &ExecutionPageRequest::default().after(past_end))
        .await
        .expect("page");
    assert!(empty.executions.is_empty() && empty.next.is_none());
    for bad in [0, MAX_EXECUTION_PAGE + 1] {
        let error = ExecutionPageRequest::new(None, Some(bad)).expect_err("out of range");
        assert_eq!(error.kind(), ErrorKind::InvalidRequest);
    }
    turn.succeed(&json!("ok")).await.expect("succeed");
    counts.insert("executions".to_owned(), claimed.len());
    report(target, "execution_pages_walk_every_execution_once", &counts);
}
