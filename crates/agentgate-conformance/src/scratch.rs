//! Scratch stores on a user's own servers, for `agentgate conformance`.
//!
//! Every check gets a fresh, empty store, as in the test targets: on
//! PostgreSQL and MySQL a database `agentgate_conformance_<run>_<n>` created
//! on the user's server (the URL's database is only used to connect), on
//! SQLite a file in a temp dir made next to the given path; with Redis a key
//! prefix `agentgate-conformance:<run>:<n>:`. `<run>` is random per run, so
//! runs never meet, and everything a run made can be found by it.
//!
//! A check's database is dropped as soon as it ends ([`Scratch::release`]);
//! [`Scratch::cleanup`] drops whatever is left (a run cut short), deletes the
//! run's Redis keys and removes the temp dir, and says what it could not.
//!
//! Opening fails fast, with one line saying why, for a URL of another kind,
//! a server that does not answer within [`CONNECT_TIMEOUT`], or a user who
//! may not create databases (naming the privilege to grant).

use agentgate_core::dburl::{redact_password as redact, with_database};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::Target;

use agentgate_store_sql::admin::reach;
pub use agentgate_store_sql::admin::CONNECT_TIMEOUT;

/// Prefix of every scratch database: leftovers of a run that could not clean
/// up are recognisable, and may be dropped freely.
pub const DATABASE_PREFIX: &str = "agentgate_conformance_";

/// Prefix of every scratch Redis key.
pub const REDIS_KEY_PREFIX: &str = "agentgate-conformance:";

/// Keys deleted per Redis `SCAN` round at cleanup.
const REDIS_SCAN_COUNT: usize = 500;

/// The kind of store and where its scratch stores go.
enum Kind {
    /// Files in a temp dir (`None` once removed or kept).
    Sqlite {
        dir: Mutex<Option<tempfile::TempDir>>,
        path: PathBuf,
    },
    /// Databases on a PostgreSQL server reached at `url`.
    Postgres { url: String },
    /// Databases on a MySQL/MariaDB server reached at `url`.
    Mysql { url: String },
}

/// One run's scratch stores on the user's servers.
pub struct Scratch {
    kind: Kind,
    redis: Option<String>,
    run: String,
    made: AtomicUsize,
    /// Scratch databases created and not dropped yet.
    live: Mutex<Vec<String>>,
}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scratch")
            .field("backend", &self.backend())
            .field("run", &self.run)
            .finish_non_exhaustive()
    }
}

impl Scratch {
    /// Checks the URLs, reaches the servers, and proves a scratch database
    /// can be created and dropped (or the SQLite temp dir made).
    ///
    /// # Errors
    /// One line saying why the run cannot start: an unsupported or malformed
    /// URL, an unreachable server, or a missing privilege.
    pub async fn open(store: &str, redis: Option<&str>) -> Result<Self, String> {
        let kind = if let Some(url) = scheme_of(store, &["postgres", "postgresql"]) {
            Kind::Postgres { url }
        } else if let Some(url) = scheme_of(store, &["mysql", "mariadb"]) {
            Kind::Mysql {
                url: url.replacen("mariadb://", "mysql://", 1),
            }
        } else if store.contains("://") && !store.starts_with("sqlite:") {
            let scheme = store.split("://").next().unwrap_or_default();
            return Err(format!(
                "unsupported store URL scheme {scheme:?}: expected a SQLite path, \
                 postgres://... or mysql://..."
            ));
        } else {
            sqlite_kind(store)?
        };
        let run = random_hex(8);
        if let Some(url) = redis {
            probe_redis(url).await?;
        }
        let scratch = Self {
            kind,
            redis: redis.map(str::to_owned),
            run,
            made: AtomicUsize::new(0),
            live: Mutex::new(Vec::new()),
        };
        // Prove the privilege before the first check: create and drop one.
        if !matches!(scratch.kind, Kind::Sqlite { .. }) {
            let target = scratch.target().await?;
            scratch.release(&target.store_url).await?;
        }
        Ok(scratch)
    }

    /// The run's random id, in every name it creates.
    pub fn run_id(&self) -> &str {
        &self.run
    }

    /// The backend, as the checks name it (`postgres+redis`, ...).
    pub fn backend(&self) -> &'static str {
        match (&self.kind, self.redis.is_some()) {
            (Kind::Sqlite { .. }, false) => "sqlite",
            (Kind::Sqlite { .. }, true) => "sqlite+redis",
            (Kind::Postgres { .. }, false) => "postgres",
            (Kind::Postgres { .. }, true) => "postgres+redis",
            (Kind::Mysql { .. }, false) => "mysql",
            (Kind::Mysql { .. }, true) => "mysql+redis",
        }
    }

    /// Whether the Redis lease layer is in the run.
    pub fn has_redis(&self) -> bool {
        self.redis.is_some()
    }

    /// Whether the store has a clock of its own (a database server).
    pub fn has_server_clock(&self) -> bool {
        !matches!(self.kind, Kind::Sqlite { .. })
    }

    /// Where the scratch stores go, without passwords: for the header.
    pub fn describe(&self) -> String {
        let store = match &self.kind {
            Kind::Sqlite { path, .. } => format!("files in {}", path.display()),
            Kind::Postgres { url } | Kind::Mysql { url } => format!(
                "databases {DATABASE_PREFIX}{}_* on {}",
                self.run,
                redact(url)
            ),
        };
        match &self.redis {
            Some(url) => format!(
                "{store}, Redis keys {REDIS_KEY_PREFIX}{}:* on {}",
                self.run,
                redact(url)
            ),
            None => store,
        }
    }

    /// A fresh, empty store for one check.
    ///
    /// # Errors
    /// When the scratch database cannot be created (the message names the
    /// privilege when that is why).
    pub async fn target(&self) -> Result<Target, String> {
        let n = self.made.fetch_add(1, Ordering::Relaxed);
        let name = format!("{DATABASE_PREFIX}{}_{n}", self.run);
        let backend = self.backend();
        let target = match &self.kind {
            Kind::Sqlite { path, .. } => {
                let file = path.join(format!("{name}.db"));
                Target::new(backend, format!("sqlite://{}", file.display()), None)
            }
            Kind::Postgres { url } => {
                self.live.lock().expect("not poisoned").push(name.clone());
                agentgate_store_postgres::admin::create_database(url, &name)
                    .await
                    .map_err(scratch_hint)?;
                Target::new(backend, with_database(url, &name), None)
            }
            Kind::Mysql { url } => {
                self.live.lock().expect("not poisoned").push(name.clone());
                agentgate_store_mysql::admin::create_database(url, &name)
                    .await
                    .map_err(scratch_hint)?;
                Target::new(backend, with_database(url, &name), None)
            }
        };
        Ok(match &self.redis {
            Some(url) => {
                let separator = if url.contains('?') { '&' } else { '?' };
                let prefix = format!("{REDIS_KEY_PREFIX}{}:{n}:", self.run);
                target.with_redis(backend, format!("{url}{separator}key_prefix={prefix}"))
            }
            None => target,
        })
    }

    /// Drops the scratch database at `store_url` (a check's) now (its Redis keys and SQLite file
    /// go at [`cleanup`](Self::cleanup)).
    ///
    /// # Errors
    /// When the database could not be dropped; it stays listed for cleanup.
    pub async fn release(&self, store_url: &str) -> Result<(), String> {
        let Some(name) = database_of(store_url) else {
            return Ok(());
        };
        match &self.kind {
            Kind::Sqlite { .. } => return Ok(()),
            Kind::Postgres { url } => {
                agentgate_store_postgres::admin::drop_database(url, &name).await?
            }
            Kind::Mysql { url } => agentgate_store_mysql::admin::drop_database(url, &name).await?,
        }
        self.live
            .lock()
            .expect("not poisoned")
            .retain(|live| *live != name);
        Ok(())
    }

    /// Removes everything the run made: scratch databases not dropped yet,
    /// the run's Redis keys, the SQLite temp dir. Returns what is left, each
    /// with why, for the user to remove by hand; empty when all is gone.
    pub async fn cleanup(&self) -> Vec<String> {
        let mut left = Vec::new();
        let live = std::mem::take(&mut *self.live.lock().expect("not poisoned"));
        for name in live {
            let dropped = match &self.kind {
                Kind::Sqlite { .. } => Ok(()),
                Kind::Postgres { url } => {
                    agentgate_store_postgres::admin::drop_database(url, &name).await
                }
                Kind::Mysql { url } => {
                    agentgate_store_mysql::admin::drop_database(url, &name).await
                }
            };
            if let Err(error) = dropped {
                left.push(format!("database {name}: {error}"));
            }
        }
        if let Some(url) = &self.redis {
            let pattern = format!("{REDIS_KEY_PREFIX}{}:*", self.run);
            if let Err(error) = delete_redis_keys(url, &pattern).await {
                left.push(format!("Redis keys {pattern}: {error}"));
            }
        }
        if let Kind::Sqlite { dir, .. } = &self.kind {
            let dir = dir.lock().expect("not poisoned").take();
            if let Some(dir) = dir {
                let path = dir.path().to_owned();
                if let Err(error) = dir.close() {
                    left.push(format!("directory {}: {error}", path.display()));
                }
            }
        }
        left
    }

    /// Keeps everything the run made (`--keep`); returns what that is.
    pub fn keep(&self) -> Vec<String> {
        let mut kept = Vec::new();
        match &self.kind {
            Kind::Sqlite { dir, path } => {
                if let Some(dir) = dir.lock().expect("not poisoned").take() {
                    let _ = dir.keep();
                }
                kept.push(format!("directory {}", path.display()));
            }
            Kind::Postgres { .. } | Kind::Mysql { .. } => {
                kept.push(format!("databases {DATABASE_PREFIX}{}_*", self.run));
            }
        }
        if self.redis.is_some() {
            kept.push(format!("Redis keys {REDIS_KEY_PREFIX}{}:*", self.run));
        }
        kept
    }
}

/// `url` when its scheme is one of `schemes`.
fn scheme_of(url: &str, schemes: &[&str]) -> Option<String> {
    let scheme = url.split_once("://")?.0;
    schemes
        .iter()
        .any(|s| s.eq_ignore_ascii_case(scheme))
        .then(|| url.to_owned())
}

/// A temp dir for SQLite next to `store` (a path or `sqlite://` URL): in it
/// when it is a directory, else in its parent; the given file is never
/// touched.
fn sqlite_kind(store: &str) -> Result<Kind, String> {
    let path = store
        .strip_prefix("sqlite://")
        .or_else(|| store.strip_prefix("sqlite:"))
        .unwrap_or(store);
    let path = path.split('?').next().unwrap_or_default();
    if path.is_empty() || path.contains(":memory:") || path.starts_with("file::memory") {
        return Err(
            "give a SQLite file path or directory: the suite's holder process must share the \
             store, which an in-memory database cannot"
                .to_owned(),
        );
    }
    let given = Path::new(path);
    let parent = if given.is_dir() {
        given
    } else {
        match given.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        }
    };
    if !parent.is_dir() {
        return Err(format!("no such directory {}", parent.display()));
    }
    let dir = tempfile::Builder::new()
        .prefix(DATABASE_PREFIX)
        .tempdir_in(parent)
        .map_err(|e| {
            format!(
                "cannot create a scratch directory in {}: {e}",
                parent.display()
            )
        })?;
    let path = dir.path().to_owned();
    Ok(Kind::Sqlite {
        dir: Mutex::new(Some(dir)),
        path,
    })
}

/// `2 * bytes` random hex digits.
fn random_hex(bytes: usize) -> String {
    let mut buffer = vec![0u8; bytes];
    getrandom::fill(&mut buffer).expect("the operating system's random source is available");
    hex::encode(buffer)
}

/// The scratch database a server URL names, if it names one.
fn database_of(url: &str) -> Option<String> {
    if url.starts_with("sqlite:") {
        return None;
    }
    url.split('?')
        .next()
        .and_then(|base| base.rsplit('/').next())
        .filter(|name| name.starts_with(DATABASE_PREFIX))
        .map(str::to_owned)
}

/// Says, after a refusal to create a database, what the suite does with the
/// privilege it asks for.
fn scratch_hint(why: String) -> String {
    format!("{why} (the conformance suite creates and drops scratch databases {DATABASE_PREFIX}*)")
}

/// The user's Redis URL for redis-rs itself: without the lease layer's own
/// parameters (`key_prefix`, TLS files), which redis-rs does not know.
pub(crate) fn redis_client_url(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let key = pair.split('=').next().unwrap_or_default();
            matches!(key, "db" | "protocol")
        })
        .collect();
    if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    }
}

async fn redis_connection(url: &str) -> Result<redis::aio::MultiplexedConnection, String> {
    let client = redis::Client::open(redis_client_url(url))
        .map_err(|e| format!("bad Redis URL {}: {e}", redact(url)))?;
    reach(url, client.get_multiplexed_async_connection()).await
}

async fn probe_redis(url: &str) -> Result<(), String> {
    let mut connection = redis_connection(url).await?;
    let ping = redis::cmd("PING");
    let answer = ping.query_async::<String>(&mut connection);
    match tokio::time::timeout(CONNECT_TIMEOUT, answer).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(error)) => Err(format!("Redis at {} refused PING: {error}", redact(url))),
        Err(_) => Err(format!(
            "no answer to PING from {} within {} s",
            redact(url),
            CONNECT_TIMEOUT.as_secs()
        )),
    }
}

/// Deletes every key matching `pattern`, by `SCAN` (never `KEYS`, which
/// would block a busy server).
async fn delete_redis_keys(url: &str, pattern: &str) -> Result<(), String> {
    let mut connection = redis_connection(url).await?;
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(REDIS_SCAN_COUNT)
            .query_async(&mut connection)
            .await
            .map_err(|e| e.to_string())?;
        if !keys.is_empty() {
            let _: i64 = redis::cmd("DEL")
                .arg(&keys)
                .query_async(&mut connection)
                .await
                .map_err(|e| e.to_string())?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_rewritten_and_redacted() {
        assert_eq!(
            with_database("postgres://u:p@h:5432/app?sslmode=require", "x"),
            "postgres://u:p@h:5432/x?sslmode=require"
        );
        assert_eq!(with_database("mysql://u@h", "x"), "mysql://u@h/x");
        assert_eq!(redact("mysql://u:secret@h/db"), "mysql://u@h/db");
        assert_eq!(
            database_of("postgres://h/agentgate_conformance_ab_1?x=1").as_deref(),
            Some("agentgate_conformance_ab_1")
        );
        assert_eq!(database_of("postgres://h/app"), None);
        assert_eq!(
            redis_client_url("redis://h/0?key_prefix=a:&protocol=resp3"),
            "redis://h/0?protocol=resp3"
        );
    }

    #[tokio::test]
    async fn bad_urls_are_refused_at_once() {
        let other = Scratch::open("mongodb://h/db", None)
            .await
            .expect_err("not a store");
        assert!(other.contains("unsupported store URL scheme"), "{other}");
        let memory = Scratch::open("sqlite::memory:", None)
            .await
            .expect_err("in memory");
        assert!(memory.contains("SQLite file path"), "{memory}");
        let missing = Scratch::open("/no/such/dir/x.db", None)
            .await
            .expect_err("missing dir");
        assert!(missing.contains("no such directory"), "{missing}");
    }

    #[tokio::test]
    async fn sqlite_scratch_is_removed() {
        let parent = tempfile::tempdir().expect("temp dir");
        let scratch = Scratch::open(parent.path().to_str().expect("utf-8"), None)
            .await
            .expect("open");
        let target = scratch.target().await.expect("target");
        let dir = match &scratch.kind {
            Kind::Sqlite { path, .. } => path.clone(),
            _ => unreachable!("a sqlite scratch"),
        };
        assert!(target.store_url.contains(&dir.display().to_string()));
        assert!(dir.is_dir());
        assert_eq!(scratch.cleanup().await, Vec::<String>::new());
        assert!(!dir.exists(), "the temp dir is removed");
    }
}
