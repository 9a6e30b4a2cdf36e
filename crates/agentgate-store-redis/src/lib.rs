//! agentgate's Redis lease layer: session leases and user permits in Redis,
//! every durable record (turns, tool executions, fences) in a SQL store.
//!
//! Each step is one Lua script, run by `EVALSHA` (loaded once, re-sent by
//! the client only if Redis lost its script cache), so it is atomic in Redis:
//! `acquire` takes the session lease and a permit together or neither,
//! `renew` extends both, `release` drops both, all owner-checked by the token
//! digest; `revoke` (an operator's force-release) drops both whoever holds
//! them. Expiry is Redis's own clock (`PEXPIRE`, `TIME`).
//!
//! The trade-off, plainly: Redis without persistence (or a failover) can
//! forget a lease, and then a second turn may start on the session while the
//! first still runs. agentgate does not pretend otherwise; it makes that
//! harmless to the data: fences come from the SQL store, and every durable
//! write is conditioned on the writer's fence being the newest for its
//! session, so the forgotten holder's writes are refused and nothing is
//! booked twice.
//!
//! Keys, under a prefix (default `agentgate:`): `s:<session>` a hash (turn,
//! digest, fence, user), `t:<turn>` a hash (session, user, digest, fence),
//! `u:<user>` a sorted set of turn ids scored by permit expiry. Scripts touch
//! keys derived inside the script, so a Redis Cluster is not supported; use a
//! single primary (with replicas) as Redisson's single-server mode does.
//!
//! Releases and new events are announced on Redis pub/sub (`announce`), so
//! waiting begins and event followers on every node wake at once where the
//! SQL store has no notification of its own.
//!
//! `connect` turns the URL into a client: `key_prefix`, and for `rediss://`
//! (TLS, the crate's `tls` feature) `ca_file`, `cert_file`, `key_file`.
#![forbid(unsafe_code)]

mod announce;
mod connect;

use agentgate_core::error::{Error, Result};
use agentgate_core::ids::{Fence, SessionId, TurnId};
use agentgate_core::lease::{Acquired, Announced, LeaseClaim, LeaseLayer, LiveLease};
use agentgate_core::limits::{
    REDIS_CONNECT_TIMEOUT, REDIS_RESPONSE_TIMEOUT, STORE_ACQUIRE_TIMEOUT,
};
use agentgate_core::model::HolderView;
use std::sync::Arc;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Script;

pub use connect::DEFAULT_KEY_PREFIX;

struct Scripts {
    acquire: Script,
    renew: Script,
    holds: Script,
    release: Script,
    revoke: Script,
    user_holders: Script,
}

impl Scripts {
    fn new() -> Self {
        Self {
            acquire: Script::new(include_str!("lua/acquire.lua")),
            renew: Script::new(include_str!("lua/renew.lua")),
            holds: Script::new(include_str!("lua/holds.lua")),
            release: Script::new(include_str!("lua/release.lua")),
            revoke: Script::new(include_str!("lua/revoke.lua")),
            user_holders: Script::new(include_str!("lua/user_holders.lua")),
        }
    }
}

/// Leases and permits in Redis.
pub struct RedisLeases {
    connection: ConnectionManager,
    prefix: String,
    scripts: Scripts,
    /// For the announcements' subscription, a connection of its own.
    client: redis::Client,
    channels: announce::Channels,
    subscriber: announce::Subscriber,
}

impl std::fmt::Debug for RedisLeases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URL may hold a password; show only the prefix.
        f.debug_struct("RedisLeases")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn map_redis(error: redis::RedisError) -> Error {
    Error::store(error)
}

impl RedisLeases {
    /// Connects to `url` (`redis://host:port/db`, or `rediss://` for TLS),
    /// optionally with `?key_prefix=...`, and for `rediss://` with
    /// `ca_file=/path/ca.pem` (a private CA instead of Mozilla's roots) and
    /// `cert_file=...&key_file=...` (a client certificate).
    ///
    /// # Errors
    /// `invalid_request` for a bad URL (an unknown parameter, TLS files on
    /// a `redis://` URL, an unreadable TLS file, `rediss://` without the
    /// `tls` feature); `store_unavailable` when Redis cannot be reached or
    /// the TLS handshake fails within the acquire timeout.
    pub async fn open(url: &str) -> Result<Self> {
        let parsed = connect::parse(url)?;
        let client = connect::client(&parsed)?;
        let prefix = parsed.prefix;
        let connection = tokio::time::timeout(
            STORE_ACQUIRE_TIMEOUT,
            ConnectionManager::new_with_config(client.clone(), manager_config()),
        )
        .await
        .map_err(|_| Error::store("timed out connecting to redis"))?
        .map_err(map_redis)?;
        Ok(Self {
            connection,
            channels: announce::Channels::new(&prefix),
            prefix,
            scripts: Scripts::new(),
            client,
            subscriber: announce::Subscriber::default(),
        })
    }

    fn key(&self, kind: &str, id: &str) -> String {
        format!("{}{kind}:{id}", self.prefix)
    }
}

/// The lease connection's timing: [`REDIS_RESPONSE_TIMEOUT`] per command,
/// and after a loss one [`REDIS_CONNECT_TIMEOUT`] attempt per call with no
/// retries inside it, so a call never waits through a reconnect's backoff
/// (redis-rs's default retries six times, 3.9 s when Redis had died).
fn manager_config() -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_response_timeout(Some(REDIS_RESPONSE_TIMEOUT))
        .set_connection_timeout(Some(REDIS_CONNECT_TIMEOUT))
        .set_number_of_retries(0)
}

fn remaining(ms: i64) -> Option<i64> {
    (ms > 0).then_some(ms)
}

#[async_trait]
impl LeaseLayer for RedisLeases {
    async fn acquire(&self, claim: &LeaseClaim<'_>) -> Result<Acquired> {
        let (status, holder, ms): (String, String, i64) = self
            .scripts
            .acquire
            .key(self.key("s", claim.session_id))
            .key(self.key("t", claim.turn_id))
            .key(self.key("u", claim.user_id))
            .arg(claim.turn_id)
            .arg(claim.token_digest)
            .arg(claim.fence.0)
            .arg(claim.ttl_ms)
            .arg(claim.cap)
            .arg(claim.session_id)
            .arg(claim.user_id)
            .invoke_async(&mut self.connection.clone())
            .await
            .map_err(map_redis)?;
        match status.as_str() {
            "granted" => Ok(Acquired::Granted {
                lease_expires_in_ms: ms,
            }),
            "busy" => Ok(Acquired::Busy {
                holder_turn_id: holder,
                expires_in_ms: ms.max(1),
            }),
            "capacity" => Ok(Acquired::AtCapacity {
                soonest_expires_in_ms: ms.max(1),
            }),
            other => Err(Error::store(format!("unexpected acquire answer {other:?}"))),
        }
    }

    async fn renew(&self, turn_id: &str, token_digest: &str, ttl_ms: i64) -> Result<Option<i64>> {
        let ms: i64 = self
            .scripts
            .renew
            .key(self.key("t", turn_id))
            .arg(turn_id)
            .arg(token_digest)
            .arg(ttl_ms)
            .arg(&self.prefix)
            .invoke_async(&mut self.connection.clone())
            .await
            .map_err(map_redis)?;
        Ok(remaining(ms))
    }

    async fn holds(&self, turn_id: &str, token_digest: &str) -> Result<Option<LiveLease>> {
        let answer: Vec<String> = self
            .scripts
            .holds
            .key(self.key("t", turn_id))
            .arg(turn_id)
            .arg(token_digest)
            .arg(&self.prefix)
            .invoke_async(&mut self.connection.clone())
            .await
            .map_err(map_redis)?;
        let [session_id, fence, ms] = answer.as_slice() else {
            return Ok(None);
        };
        let parse = |text: &str| {
            text.parse::<i64>()
                .map_err(|e| Error::store(format!("bad lease field {text:?}: {e}")))
        };
        let expires_in_ms = parse(ms)?;
        let fence = Fence(parse(fence)?);
        Ok(remaining(expires_in_ms).map(|expires_in_ms| LiveLease {
            session_id: session_id.clone(),
            fence,
            expires_in_ms,
        }))
    }

    async fn release(&self, turn_id: &str, token_digest: &str) -> Result<()> {
        let _released: i64 = self
            .scripts
            .release
            .key(self.key("t", turn_id))
            .arg(turn_id)
            .arg(token_digest)
            .arg(&self.prefix)
            .invoke_async(&mut self.connection.clone())
            .await
            .map_err(map_redis)?;
        Ok(())
    }

    async fn revoke(&self, turn_id: &str) -> Result<()> {
        let _revoked: i64 = self
            .scripts
            .revoke
            .key(self.key("t", turn_id))
            .arg(turn_id)
            .arg(&self.prefix)
            .invoke_async(&mut self.connection.clone())
            .await
            .map_err(map_redis)?;
        Ok(())
    }

    async fn holder(&self, session_id: &str) -> Result<Option<HolderView>> {
        let mut connection = self.connection.clone();
        let key = self.key("s", session_id);
        let (turn, fence, ms): (Option<String>, Option<i64>, i64) = redis::pipe()
            .atomic()
            .hget(&key, "turn")
            .hget(&key, "fence")
            .pttl(&key)
            .query_async(&mut connection)
            .await
            .map_err(map_redis)?;
        match (turn, fence, remaining(ms)) {
            (Some(turn), Some(fence), Some(ms)) => {
                Ok(Some(holder_view(session_id, &turn, fence, ms)?))
            }
            _ => Ok(None),
        }
    }

    async fn user_holders(&self, user_id: &str) -> Result<Vec<HolderView>> {
        let flat: Vec<String> = self
            .scripts
            .user_holders
            .key(self.key("u", user_id))
            .arg(&self.prefix)
            .invoke_async(&mut self.connection.clone())
            .await
            .map_err(map_redis)?;
        flat.chunks_exact(4)
            .filter_map(|row| {
                let fence = row[2].parse().ok()?;
                let ms = remaining(row[3].parse().ok()?)?;
                Some(holder_view(&row[0], &row[1], fence, ms))
            })
            .collect()
    }

    async fn announce_release(&self, session_id: &str) {
        self.channels.released(&self.connection, session_id).await;
    }

    async fn announce_events(&self, turn_id: &str) {
        self.channels.events(&self.connection, turn_id).await;
    }

    fn listen(&self, to: Arc<dyn Announced>) {
        self.subscriber.start(&self.client, &self.channels, to);
    }
}

fn holder_view(session_id: &str, turn_id: &str, fence: i64, ms: i64) -> Result<HolderView> {
    let corrupt = |e: Error| Error::store(format!("corrupt lease key: {e}"));
    Ok(HolderView {
        session_id: SessionId::new(session_id).map_err(corrupt)?,
        turn_id: TurnId::new(turn_id).map_err(corrupt)?,
        fence: Fence(fence),
        lease_expires_in_ms: ms,
        // The layer keeps leases, not turns: the SQL store's views read
        // this from the turn's row.
        cancel_requested: false,
    })
}
