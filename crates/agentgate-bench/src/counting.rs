//! The counting pass: a known number of turns, one after another, on
//! connections of their own, with every counter of [`crate::count`] read
//! around them. Separate from the throughput loops, so counting costs them
//! nothing and they cannot blur the count.
//!
//! Per store:
//! - SQLite: calls into SQLite = sqlx statement events + 2 × the explicit
//!   transactions the store began (`BEGIN IMMEDIATE … COMMIT`, which sqlx
//!   runs without an event; single-statement steps run in autocommit). The
//!   raw baseline runs no explicit transaction: its calls are its statements.
//! - PostgreSQL, MySQL, Redis: round trips on the wire, through
//!   [`crate::count::wire::WireProxy`].

use std::sync::Arc;

use agentgate::{Config, Gate};
use serde::Serialize;

use crate::count::wire::{Counts, Protocol, WireProxy};
use crate::count::{statements_counted, Window};
use crate::error::Result;
use crate::library::LibraryTurns;
use crate::limits::COUNT_WARMUP_TURNS;
use crate::raw::{RawTurns, SqlPool};
use crate::target::{Dialect, Target};
use crate::url::Url;
use crate::workload::{drive_sequential, TurnLoop};

/// What one pass counted, per turn.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PassCount {
    /// All round trips: SQL plus Redis.
    pub round_trips_per_turn: Option<f64>,
    /// Round trips to the SQL store (SQLite: calls into SQLite).
    pub sql_round_trips_per_turn: Option<f64>,
    /// Of the SQL round trips, the pings sqlx sends when a connection goes
    /// back to its pool (PostgreSQL, MySQL; on SQLite the same ping is a
    /// message to the connection's worker thread and is not counted).
    pub sql_pings_per_turn: Option<f64>,
    /// Redis commands (each one round trip).
    pub redis_round_trips_per_turn: Option<f64>,
    /// sqlx statement events (no `BEGIN` on SQLite/PostgreSQL, no `COMMIT` on SQLite).
    pub statements_per_turn: Option<f64>,
    /// SQLite: explicit transactions begun (single statements run in
    /// autocommit and are not counted here).
    pub transactions_per_turn: Option<f64>,
}

/// Both passes and how they were counted.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RoundTrips {
    /// How the figures were obtained.
    pub method: String,
    /// Turns counted per pass (after the warm-up turns).
    pub turns_counted: u32,
    /// The engine through the library.
    pub engine: PassCount,
    /// The raw baseline.
    pub raw: PassCount,
}

/// The proxies of a pass: one in front of the SQL server, one in front of
/// Redis. Kept alive until the run ends (see [`Counted`]).
pub(crate) struct Proxies {
    sql: Option<WireProxy>,
    redis: Option<WireProxy>,
}

impl Proxies {
    async fn start(target: &Target) -> Result<Self> {
        let sql = match target.dialect {
            Dialect::Sqlite => None,
            Dialect::Postgres => proxy(&target.store_url, 5432, Protocol::Postgres).await?,
            Dialect::MySql => proxy(&target.store_url, 3306, Protocol::MySql).await?,
        };
        let redis = match &target.redis_base_url {
            Some(url) if url.starts_with("redis://") => proxy(url, 6379, Protocol::Redis).await?,
            _ => None,
        };
        Ok(Self { sql, redis })
    }

    fn snapshot(&self) -> (Option<Counts>, Option<Counts>) {
        (
            self.sql.as_ref().and_then(WireProxy::counts),
            self.redis.as_ref().and_then(WireProxy::counts),
        )
    }
}

async fn proxy(url: &str, default_port: u16, protocol: Protocol) -> Result<Option<WireProxy>> {
    match Url::parse(url)?.host_port(default_port) {
        Some(upstream) => Ok(Some(WireProxy::start(upstream, protocol).await?)),
        None => Ok(None),
    }
}

/// `url` pointed at `proxy`, with TLS off so the proxy can read it.
fn through(url: &str, proxy: Option<&WireProxy>, dialect: Option<Dialect>) -> Result<String> {
    let Some(proxy) = proxy else {
        return Ok(url.to_owned());
    };
    let moved = Url::parse(url)?.with_host_port(&proxy.host_port());
    Ok(match dialect {
        Some(Dialect::Postgres) => moved.with_param("sslmode", "disable"),
        Some(Dialect::MySql) => moved.with_param("ssl-mode", "disabled"),
        _ => moved,
    }
    .to_url_string())
}

/// What the counting pass returns: the counts, and its proxies, which the
/// caller keeps until the run ends, so a connection of a closed pool that is
/// still being handed back never finds its socket gone (sqlx would log a
/// failed release ping).
pub(crate) struct Counted {
    /// The counts.
    pub round_trips: RoundTrips,
    /// The proxies, to drop last.
    pub proxies: Proxies,
}

/// Counts the engine's and the raw baseline's round trips over `turns` turns.
///
/// # Errors
/// When a store cannot be opened or a turn fails.
pub(crate) async fn count(target: &Target, config: &Config, turns: u32) -> Result<Counted> {
    let proxies = Proxies::start(target).await?;
    let sql_url = through(
        &target.store_url,
        proxies.sql.as_ref(),
        Some(target.dialect),
    )?;
    let redis_url = target
        .redis_url
        .as_deref()
        .map(|url| through(url, proxies.redis.as_ref(), None))
        .transpose()?;
    let redis_base = target
        .redis_base_url
        .as_deref()
        .map(|url| through(url, proxies.redis.as_ref(), None))
        .transpose()?;

    let (gate, engine_transactions) =
        open_engine(target, &sql_url, redis_url.as_deref(), config).await?;
    let engine_loop = LibraryTurns::new(gate);
    let engine = count_pass(&engine_loop, &proxies, engine_transactions, turns).await?;
    drop(engine_loop);

    let pool = SqlPool::open(target.dialect, &sql_url).await?;
    // The raw baseline is autocommit only: no explicit transactions.
    let raw_transactions: Option<Transactions> = match &pool {
        SqlPool::Sqlite(_) => Some(Box::new(|| 0)),
        _ => None,
    };
    let redis_raw = redis_base.as_deref().zip(target.redis_prefix.as_deref());
    let raw_loop = RawTurns::open(pool.clone(), redis_raw, 1).await?;
    let raw = count_pass(&raw_loop, &proxies, raw_transactions, turns).await?;
    pool.close().await;

    Ok(Counted {
        round_trips: RoundTrips {
            method: method(target, statements_counted(), &proxies),
            turns_counted: turns,
            engine,
            raw,
        },
        proxies,
    })
}

/// Reads how many explicit SQLite transactions a pass's store has begun.
type Transactions = Box<dyn Fn() -> u64 + Send + Sync>;

/// The engine on its own connections; on SQLite, with its explicit
/// transactions counted.
async fn open_engine(
    target: &Target,
    sql_url: &str,
    redis_url: Option<&str>,
    config: &Config,
) -> Result<(Gate, Option<Transactions>)> {
    if target.dialect != Dialect::Sqlite {
        return Ok((
            Gate::connect(sql_url, redis_url, config.clone()).await?,
            None,
        ));
    }
    let layer = match redis_url {
        Some(url) => Some(
            Arc::new(agentgate_store_redis::RedisLeases::open(url).await?)
                as Arc<dyn agentgate_core::lease::LeaseLayer>,
        ),
        None => None,
    };
    let store = Arc::new(
        agentgate_store_sqlite::SqliteStore::open_with_leases(sql_url, config.clone(), layer)
            .await?,
    );
    let counted = Arc::clone(&store);
    let transactions: Transactions = Box::new(move || counted.transactions_begun());
    Ok((Gate::with_store(store), Some(transactions)))
}

async fn count_pass(
    turns_loop: &dyn TurnLoop,
    proxies: &Proxies,
    transactions: Option<Transactions>,
    turns: u32,
) -> Result<PassCount> {
    drive_sequential(turns_loop, COUNT_WARMUP_TURNS).await?;
    let (sql_before, redis_before) = proxies.snapshot();
    let transactions_before = transactions.as_ref().map(|begun| begun());
    // Markers for checking a count by hand: run with
    // RUST_LOG=sqlx::query=debug,agentgate_bench=info and read the
    // statements between them.
    tracing::info!(turns, "counting window open");
    let window = Window::open();
    drive_sequential(turns_loop, turns).await?;
    let statements = window.close();
    tracing::info!(?statements, "counting window closed");
    let (sql_after, redis_after) = proxies.snapshot();
    let transactions_after = transactions.as_ref().map(|begun| begun());

    let per_turn = |count: u64| count as f64 / f64::from(turns);
    let delta = |before: Option<u64>, after: Option<u64>| after.zip(before).map(|(a, b)| a - b);
    let requests = |counts: Option<Counts>| counts.map(|c| c.requests);
    let pings = |counts: Option<Counts>| counts.map(|c| c.pings);
    let transactions = delta(transactions_before, transactions_after);
    let sql_round_trips = match (&proxies.sql, transactions) {
        (Some(_), _) => delta(requests(sql_before), requests(sql_after)),
        // SQLite: one call per statement, plus BEGIN and COMMIT/ROLLBACK of
        // every explicit transaction.
        (None, Some(begun)) => statements.map(|s| s + 2 * begun),
        (None, None) => None,
    };
    let redis_round_trips = match &proxies.redis {
        Some(_) => delta(requests(redis_before), requests(redis_after)),
        None => Some(0),
    };
    let total = sql_round_trips.zip(redis_round_trips).map(|(s, r)| s + r);
    Ok(PassCount {
        round_trips_per_turn: total.map(per_turn),
        sql_round_trips_per_turn: sql_round_trips.map(per_turn),
        sql_pings_per_turn: proxies
            .sql
            .as_ref()
            .and(delta(pings(sql_before), pings(sql_after)))
            .map(per_turn),
        redis_round_trips_per_turn: proxies.redis.as_ref().and(redis_round_trips).map(per_turn),
        statements_per_turn: statements.map(per_turn),
        transactions_per_turn: transactions.map(per_turn),
    })
}

fn method(target: &Target, statements: bool, proxies: &Proxies) -> String {
    let mut parts = Vec::new();
    match (target.dialect, &proxies.sql) {
        (Dialect::Sqlite, _) if statements => parts.push(
            "SQLite: sqlx statement events + 2 x the explicit transactions the store began \
             (BEGIN IMMEDIATE..COMMIT; single-statement steps are autocommit); the raw baseline \
             is autocommit",
        ),
        (Dialect::Sqlite, _) => {
            parts.push("SQLite: not counted (the statement counter is not installed)")
        }
        (_, Some(_)) => parts.push(
            "SQL: requests on the wire through a counting loopback proxy \
             (PostgreSQL ReadyForQuery messages / MySQL command packets)",
        ),
        (_, None) => parts.push("SQL: not counted (no TCP host in the URL)"),
    }
    if target.redis_url.is_some() {
        parts.push(if proxies.redis.is_some() {
            "Redis: commands on the wire through a counting loopback proxy (a script is one EVALSHA)"
        } else {
            "Redis: not counted (not a redis:// URL)"
        });
    }
    parts.join("; ")
}
