//! Redis forgets: a lease layer that loses its keys (restart without
//! persistence, failover) lets a second turn start on the session, but the
//! SQL fence check refuses every write of the forgotten holder, so nothing is
//! booked twice.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use agentgate::{ErrorKind, Gate, ToolStep, TurnState};
use agentgate_core::canonical::CanonicalJson;
use agentgate_core::error::Result;
use agentgate_core::ids::{ClientRequestId, Fence, SessionId, UserId};
use agentgate_core::lease::{Acquired, LeaseClaim, LeaseLayer, LiveLease};
use agentgate_core::model::{BeginCommand, BeginOutcome, Ending, HolderView, LeaseRef};
use async_trait::async_trait;
use serde_json::json;

use super::{config, must_start, report};
use crate::{ledger, Target};

/// Bound on keys deleted when simulating a Redis loss for one target.
const MAX_FORGOTTEN_KEYS: usize = 10_000;

/// Deletes every key under the target's prefix: to this target, Redis
/// restarted empty. Other keys are untouched, and found with `SCAN`, not
/// `KEYS`, which would block a busy server (`agentgate conformance` runs
/// this on a user's own Redis).
async fn forget_leases(redis_url: &str) {
    let (_, query) = redis_url
        .split_once('?')
        .expect("redis targets carry a key_prefix");
    let prefix = query
        .split('&')
        .rev()
        .find_map(|p| p.strip_prefix("key_prefix="))
        .expect("key_prefix");
    let client =
        redis::Client::open(crate::scratch::redis_client_url(redis_url)).expect("redis url");
    let mut connection = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect redis");
    let mut cursor: u64 = 0;
    let mut forgotten = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut connection)
            .await
            .expect("scan keys");
        forgotten += keys.len();
        assert!(
            forgotten < MAX_FORGOTTEN_KEYS,
            "a test prefix holds few keys"
        );
        if !keys.is_empty() {
            let _: i64 = redis::cmd("DEL")
                .arg(&keys)
                .query_async(&mut connection)
                .await
                .expect("delete keys");
        }
        if next == 0 {
            return;
        }
        cursor = next;
    }
}

/// Redis loses the holder's lease mid-turn: a new turn may start, the old
/// holder's writes are all refused, and the ledger has one row.
pub async fn redis_loss_is_fenced(target: &Target) {
    let redis_url = target.redis_url.as_deref().expect("a redis target");
    let gate = target.gate(config()).await;
    ledger::prepare(&target.store_url).await;
    let old = must_start(&gate, "loss-user", "loss-session", "a").await;
    let ToolStep::Execute(stale) = old
        .tool("book", &json!({"amount": 7}))
        .await
        .expect("claim")
    else {
        panic!("a new call executes");
    };
    forget_leases(redis_url).await;
    let new = must_start(&gate, "loss-user", "loss-session", "b").await;
    assert!(new.fence() > old.fence());
    let mut counts = BTreeMap::new();
    let refused = stale
        .complete_in_tx(ledger::book("loss-7".into(), 7, false))
        .await
        .expect_err("the forgotten holder cannot book");
    assert_eq!(refused.kind(), ErrorKind::LeaseLost, "{refused}");
    counts.insert("old_holder_booking_refused".to_owned(), 1);
    let ToolStep::Execute(fresh) = new
        .tool("book", &json!({"amount": 7}))
        .await
        .expect("claim")
    else {
        panic!("the new turn's call executes");
    };
    fresh
        .complete_in_tx(ledger::book("loss-7".into(), 7, false))
        .await
        .expect("the new holder books");
    let lost = old
        .succeed(&json!("stale answer"))
        .await
        .expect_err("the old holder cannot end");
    assert_eq!(lost.kind(), ErrorKind::LeaseLost);
    counts.insert("old_holder_ending_refused".to_owned(), 1);
    new.succeed(&json!("ok")).await.expect("succeed");
    let rows = ledger::count(&target.store_url, "loss-7").await;
    assert_eq!(rows, 1, "booked once");
    counts.insert(
        "ledger_rows".to_owned(),
        usize::try_from(rows).expect("a count is not negative"),
    );
    report(target, "redis_loss_is_fenced", &counts);
}

/// A lease layer that keeps saying a lost lease is held (the worst a
/// split-brain Redis could do). Only the SQL fence check stands between the
/// stale holder and the data.
#[derive(Debug)]
struct Liar {
    inner: Arc<dyn LeaseLayer>,
    granted: Mutex<HashMap<String, (String, Fence)>>,
}

#[async_trait]
impl LeaseLayer for Liar {
    async fn acquire(&self, claim: &LeaseClaim<'_>) -> Result<Acquired> {
        let acquired = self.inner.acquire(claim).await?;
        if matches!(acquired, Acquired::Granted { .. }) {
            self.granted.lock().expect("not poisoned").insert(
                claim.turn_id.to_owned(),
                (claim.session_id.to_owned(), claim.fence),
            );
        }
        Ok(acquired)
    }
    async fn renew(&self, turn_id: &str, token_digest: &str, ttl_ms: i64) -> Result<Option<i64>> {
        self.inner.renew(turn_id, token_digest, ttl_ms).await
    }
    async fn holds(&self, turn_id: &str, token_digest: &str) -> Result<Option<LiveLease>> {
        if let Some(live) = self.inner.holds(turn_id, token_digest).await? {
            return Ok(Some(live));
        }
        let granted = self
            .granted
            .lock()
            .expect("not poisoned")
            .get(turn_id)
            .cloned();
        Ok(granted.map(|(session_id, fence)| LiveLease {
            session_id,
            fence,
            expires_in_ms: 10_000,
        }))
    }
    async fn release(&self, turn_id: &str, token_digest: &str) -> Result<()> {
        self.inner.release(turn_id, token_digest).await
    }
    async fn revoke(&self, turn_id: &str) -> Result<()> {
        self.inner.revoke(turn_id).await
    }
    async fn holder(&self, session_id: &str) -> Result<Option<HolderView>> {
        self.inner.holder(session_id).await
    }
    async fn user_holders(&self, user_id: &str) -> Result<Vec<HolderView>> {
        self.inner.user_holders(user_id).await
    }
}

/// With a layer that lies, a stale holder's tool claim, completion and
/// ending are still refused, by the SQL store's newest-fence check.
pub async fn lying_lease_layer_is_refused_by_the_sql_fence(target: &Target) {
    let redis_url = target.redis_url.as_deref().expect("a redis target");
    let real = agentgate_store_redis::RedisLeases::open(redis_url)
        .await
        .expect("redis");
    let liar = Arc::new(Liar {
        inner: Arc::new(real),
        granted: Mutex::new(HashMap::new()),
    });
    let gate = Gate::connect_with_layer(&target.store_url, liar, config())
        .await
        .expect("open");
    let old = must_start(&gate, "liar-user", "liar-session", "a").await;
    let ToolStep::Execute(stale) = old
        .tool("book", &json!({"amount": 9}))
        .await
        .expect("claim")
    else {
        panic!("a new call executes");
    };
    forget_leases(redis_url).await;
    let new = must_start(&gate, "liar-user", "liar-session", "b").await;
    let mut counts = BTreeMap::new();
    let refusals = [
        (
            "tool_complete",
            stale.complete(&json!("stale")).await.map(drop),
        ),
        ("tool_claim", old.tool("email", &json!({})).await.map(drop)),
        ("heartbeat", old.heartbeat().await.map(drop)),
    ];
    for (what, result) in refusals {
        let error = result.expect_err(what);
        assert_eq!(error.kind(), ErrorKind::LeaseLost, "{what}: {error}");
        assert!(error.to_string().contains("newer fence"), "{what}: {error}");
        counts.insert(format!("refused_{what}"), 1);
    }
    let old_id = old.id().clone();
    let ending = old
        .succeed(&json!("stale"))
        .await
        .expect_err("stale ending");
    assert_eq!(ending.kind(), ErrorKind::LeaseLost);
    counts.insert("refused_ending".to_owned(), 1);
    let view = gate
        .store()
        .turn(&old_id)
        .await
        .expect("view")
        .expect("turn");
    assert_eq!(
        view.state,
        TurnState::Running,
        "the stale holder changed nothing"
    );
    new.succeed(&json!("ok"))
        .await
        .expect("the new holder is unaffected");
    report(
        target,
        "lying_lease_layer_is_refused_by_the_sql_fence",
        &counts,
    );
}

/// A lease layer whose release always fails, as when Redis is unreachable
/// at the moment a turn ends: the ending is stored in SQL, the layer's key
/// lives on until its TTL.
#[derive(Debug)]
struct Sticky {
    inner: Arc<dyn LeaseLayer>,
}

#[async_trait]
impl LeaseLayer for Sticky {
    async fn acquire(&self, claim: &LeaseClaim<'_>) -> Result<Acquired> {
        self.inner.acquire(claim).await
    }
    async fn renew(&self, turn_id: &str, token_digest: &str, ttl_ms: i64) -> Result<Option<i64>> {
        self.inner.renew(turn_id, token_digest, ttl_ms).await
    }
    async fn holds(&self, turn_id: &str, token_digest: &str) -> Result<Option<LiveLease>> {
        self.inner.holds(turn_id, token_digest).await
    }
    async fn release(&self, _turn_id: &str, _token_digest: &str) -> Result<()> {
        Err(agentgate::Error::store(
            "injected: redis unreachable at release",
        ))
    }
    async fn revoke(&self, turn_id: &str) -> Result<()> {
        self.inner.revoke(turn_id).await
    }
    async fn holder(&self, session_id: &str) -> Result<Option<HolderView>> {
        self.inner.holder(session_id).await
    }
    async fn user_holders(&self, user_id: &str) -> Result<Vec<HolderView>> {
        self.inner.user_holders(user_id).await
    }
}

/// docs/protocol.md §3.0: `lease_lost` also means "turn already ended". An ended turn's
/// heartbeat is refused even when the best-effort release in the layer
/// failed and the layer would still renew the key.
pub async fn heartbeat_after_an_ending_is_refused_when_the_release_failed(target: &Target) {
    let redis_url = target.redis_url.as_deref().expect("a redis target");
    let real = agentgate_store_redis::RedisLeases::open(redis_url)
        .await
        .expect("redis");
    let sticky = Arc::new(Sticky {
        inner: Arc::new(real),
    });
    let gate = Gate::connect_with_layer(&target.store_url, sticky, config())
        .await
        .expect("open");
    let store = gate.store();
    let command = BeginCommand::new(
        UserId::new("sticky-user").expect("id"),
        SessionId::new("sticky-session").expect("id"),
        ClientRequestId::new("r").expect("id"),
        &json!({"text": "r"}),
        None,
    )
    .expect("command");
    let BeginOutcome::Started(grant) = store.begin(&command).await.expect("begin") else {
        panic!("a new request starts");
    };
    let lease = LeaseRef {
        turn_id: grant.turn_id.clone(),
        token: grant.lease_token.clone(),
    };
    store.heartbeat(&lease).await.expect("a live lease renews");
    let response = CanonicalJson::new("response", &json!("done")).expect("json");
    let view = store
        .end_turn(&lease, &Ending::Succeed { response })
        .await
        .expect("the ending is stored although the release failed");
    assert_eq!(view.state, TurnState::Succeeded);
    let mut refused = 0;
    for what in ["first", "second"] {
        let error = store
            .heartbeat(&lease)
            .await
            .expect_err("an ended turn's lease renews no more");
        assert_eq!(error.kind(), ErrorKind::LeaseLost, "{what}: {error}");
        refused += 1;
    }
    let counts = [("heartbeats_after_end_refused".to_owned(), refused)];
    report(
        target,
        "heartbeat_after_an_ending_is_refused_when_the_release_failed",
        &counts.into_iter().collect(),
    );
}
