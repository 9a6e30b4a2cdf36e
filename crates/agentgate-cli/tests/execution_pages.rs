//! Black-box test of reading a turn's tool executions in pages over HTTP
//! (`GET /v1/turns/{turn_id}` and `GET /v1/turns/{turn_id}/executions`):
//! with results of 1 MB, every response body stays within the page byte
//! limit, the pages carry every execution once, in order, and a bad cursor
//! or page size is 400 `invalid_request`.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[allow(dead_code)] // the support module serves several test binaries
mod support;

use agentgate::limits::{MAX_EXECUTION_PAGE, MAX_EXECUTION_PAGE_BYTES};
use serde_json::{json, Value};
use support::{lease, scratch, Server};

/// Executions in the turn.
const EXECUTIONS: usize = 10;

/// Characters of each result: four fit the page byte limit, five do not.
const RESULT_CHARS: usize = 1_000_000;

/// What a page body carries besides results: the turn, and per execution
/// its ids, tool, state and numbers (a few hundred bytes each).
const ENVELOPE_BYTES: usize = 64 * 1024;

fn ids(page: &Value) -> Vec<String> {
    page["executions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["execution_id"].as_str().unwrap().to_owned())
        .collect()
}

/// Claims [`EXECUTIONS`] tool calls of the turn and completes each with a
/// [`RESULT_CHARS`]-character result (heartbeating before each when
/// `heartbeat`, for a short lease); their execution ids in claim order.
async fn claim_and_complete(
    client: &support::Client,
    turn_id: &str,
    token: &str,
    heartbeat: bool,
) -> Vec<String> {
    let tools = format!("/v1/turns/{turn_id}/tools");
    let filler = "x".repeat(RESULT_CHARS);
    let mut claimed = Vec::new();
    for i in 0..EXECUTIONS {
        if heartbeat {
            client
                .post(
                    &format!("/v1/turns/{turn_id}/heartbeat"),
                    Some(token),
                    &json!({}),
                )
                .await
                .expect(200, "");
        }
        let claim = client
            .post(
                &tools,
                Some(token),
                &json!({"tool": "export", "args": {"i": i}}),
            )
            .await
            .expect(201, "");
        let id = claim.body["execution"]["execution_id"]
            .as_str()
            .unwrap()
            .to_owned();
        client
            .post(
                &format!("{tools}/{id}/complete"),
                Some(token),
                &json!({"result": filler}),
            )
            .await
            .expect(200, "");
        claimed.push(id);
    }
    claimed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_executions_are_paged_and_each_body_is_bounded() {
    let dir = scratch();
    let server = Server::start(dir.path(), &[]);
    let client = server.client();
    let (turn_id, token) = lease(
        &client
            .begin("paula", "chat-1", "msg-1", &json!({"text": "big"}))
            .await,
    );
    // Claimed back to back: many share a store-clock millisecond, and the
    // pages must still follow claim order.
    let claimed = claim_and_complete(&client, &turn_id, &token, false).await;
    let bound = MAX_EXECUTION_PAGE_BYTES + ENVELOPE_BYTES;

    let first = client
        .get(&format!("/v1/turns/{turn_id}"))
        .await
        .expect(200, "");
    assert!(
        first.text.len() <= bound,
        "turn body {} bytes",
        first.text.len()
    );
    assert_eq!(first.body["turn"]["turn_id"], turn_id.as_str());
    let mut walked = ids(&first.body);
    assert_eq!(walked.len(), 4, "four 1 MB results fit 4 MiB, five do not");
    let mut next = first.body["executions_next"].as_str().map(str::to_owned);
    let mut bodies = vec![first.text.len()];
    while let Some(after) = next {
        let page = client
            .get(&format!("/v1/turns/{turn_id}/executions?after={after}"))
            .await
            .expect(200, "");
        assert!(
            page.text.len() <= bound,
            "page body {} bytes",
            page.text.len()
        );
        bodies.push(page.text.len());
        walked.extend(ids(&page.body));
        next = page.body["executions_next"].as_str().map(str::to_owned);
        assert!(bodies.len() <= EXECUTIONS + 1, "the walk ends");
    }
    assert_eq!(walked, claimed, "every execution once, in claim order");
    assert_eq!(bodies.len(), 3, "4 + 4 + 2: {bodies:?}");

    // A smaller page size is honoured, and so is the cursor it hands out.
    let small = client
        .get(&format!("/v1/turns/{turn_id}/executions?limit=3"))
        .await
        .expect(200, "");
    assert_eq!(ids(&small.body), claimed[..3]);
    let after = small.body["executions_next"].as_str().unwrap();
    let rest = client
        .get(&format!(
            "/v1/turns/{turn_id}/executions?limit=3&after={after}"
        ))
        .await
        .expect(200, "");
    assert_eq!(ids(&rest.body), claimed[3..6]);

    // Bad cursors and page sizes: 400 invalid_request.
    let too_many = MAX_EXECUTION_PAGE + 1;
    for query in [
        "after=nonsense".to_owned(),
        "after=12.turn_abc".to_owned(),
        "after=-5.exec_1".to_owned(),
        // Past any claim number: the `<created_at_ms>.<id>` cursor of an
        // older release.
        "after=1764600000000.exec_1".to_owned(),
        "after=".to_owned(),
        "limit=0".to_owned(),
        format!("limit={too_many}"),
        "limit=-1".to_owned(),
        "limit=ten".to_owned(),
    ] {
        client
            .get(&format!("/v1/turns/{turn_id}/executions?{query}"))
            .await
            .expect(400, "invalid_request");
    }
    client
        .get("/v1/turns/turn_nope/executions")
        .await
        .expect(404, "not_found");
    client
        .get(&format!(
            "/v1/turns/{turn_id}/executions?user_id=someone_else"
        ))
        .await
        .expect(404, "not_found");
}

/// An orphan claim over a turn of ten 1 MB results answers the journal's
/// first page only (within the page byte limit) and the cursor of the
/// rest; walking `GET /v1/turns/{id}/executions` from it yields every other
/// execution once. Before, the claim answered the whole journal in one
/// body (187 MB for 180 such results).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphan_claims_journal_is_paged_and_its_body_bounded() {
    let dir = scratch();
    let server = Server::start(dir.path(), &["--lease-ttl-ms", "2000"]);
    let client = server.client();
    let (turn_id, token) = lease(
        &client
            .begin("oscar", "chat-1", "msg-1", &json!({"text": "big"}))
            .await,
    );
    let claimed = claim_and_complete(&client, &turn_id, &token, true).await;
    // The holder goes silent; past its 2 s lease the turn is an orphan.
    let claim = loop {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let reply = client
            .post("/v1/orphans/claim", None, &json!({"turn_ids": [turn_id]}))
            .await;
        if reply.status == 201 {
            break reply;
        }
        assert_eq!(reply.status, 204, "{}", reply.text);
    };
    let bound = MAX_EXECUTION_PAGE_BYTES + ENVELOPE_BYTES;
    assert!(
        claim.text.len() <= bound,
        "the claim's body is {} bytes, over {bound}",
        claim.text.len()
    );
    let journal: Vec<String> = claim.body["journal"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["execution_id"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        !journal.is_empty() && journal.len() < EXECUTIONS,
        "{journal:?}"
    );
    let mut walked = journal;
    let mut next = claim.body["journal_next"].as_str().map(str::to_owned);
    assert!(next.is_some(), "a cursor for the rest");
    while let Some(after) = next {
        let page = client
            .get(&format!("/v1/turns/{turn_id}/executions?after={after}"))
            .await
            .expect(200, "");
        assert!(
            page.text.len() <= bound,
            "a page of {} bytes",
            page.text.len()
        );
        walked.extend(ids(&page.body));
        next = page.body["executions_next"].as_str().map(str::to_owned);
    }
    assert_eq!(walked, claimed, "every execution once, in claim order");
}
