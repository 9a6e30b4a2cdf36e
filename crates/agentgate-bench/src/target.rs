//! The run's own store: a fresh SQLite file, a fresh database on a
//! PostgreSQL or MySQL server, a fresh Redis key prefix. A bench never
//! writes where user data may live, and removes what it created when the
//! run ends (also after a failure or Ctrl-C: see [`Target::cleanup`]).
//!
//! - SQLite: a temp file, or the `sqlite://PATH` given, which must not exist
//!   yet; the file and its `-wal`/`-shm` companions are deleted after.
//! - PostgreSQL / MySQL: the URL names a server and a database to connect
//!   to; the bench creates `agentgate_bench_<random>` there, runs in it, and
//!   drops it after (`DROP DATABASE … WITH (FORCE)` on PostgreSQL).
//! - Redis: `key_prefix=agentgate-bench-<random>:`; the keys under it are
//!   deleted after with `SCAN` + `UNLINK`.

use std::path::PathBuf;

use sqlx::{Connection, Executor};

use crate::error::{BenchError, Result};
use crate::limits::{MAX_REDIS_SCAN_CALLS, REDIS_SCAN_BATCH};
use crate::url::Url;

/// Which SQL dialect a store speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dialect {
    /// Embedded SQLite.
    Sqlite,
    /// PostgreSQL.
    Postgres,
    /// MySQL or MariaDB.
    MySql,
}

impl Dialect {
    /// The dialect of a store URL.
    pub(crate) fn of(url: &str) -> Result<Self> {
        let scheme = url.split(':').next().unwrap_or_default();
        match scheme.to_ascii_lowercase().as_str() {
            "sqlite" => Ok(Self::Sqlite),
            "postgres" | "postgresql" => Ok(Self::Postgres),
            "mysql" | "mariadb" => Ok(Self::MySql),
            other => Err(BenchError::Options(format!(
                "unsupported store scheme {other:?}; expected sqlite://, postgres:// or mysql://"
            ))),
        }
    }

    /// The name used in reports.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Sqlite => "sqlite",
            Self::Postgres => "postgres",
            Self::MySql => "mysql",
        }
    }
}

/// What the run created, to remove after.
#[derive(Debug)]
enum Owned {
    /// A temp directory holding the SQLite file; removed with it.
    TempDir(tempfile::TempDir),
    /// A SQLite file the user named.
    SqliteFile(PathBuf),
    /// A database created on a server, with the URL to drop it through.
    Database { admin_url: String, name: String },
}

/// The run's store.
#[derive(Debug)]
pub(crate) struct Target {
    /// Its dialect.
    pub dialect: Dialect,
    /// The URL of the run's own database or file.
    pub store_url: String,
    /// The Redis lease layer's URL with the run's `key_prefix`.
    pub redis_url: Option<String>,
    /// The user's Redis URL without any `key_prefix` (raw baseline, clean-up).
    pub redis_base_url: Option<String>,
    /// The run's Redis key prefix.
    pub redis_prefix: Option<String>,
    /// What the store is, for reports, without credentials.
    pub label: String,
    owned: Owned,
}

/// 64 random bits as hex: unique names for a run's database and prefix.
fn random_suffix() -> Result<String> {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes)
        .map_err(|e| BenchError::io("no randomness", std::io::Error::other(e.to_string())))?;
    Ok(hex::encode(bytes))
}

impl Target {
    /// Creates the run's store from the user's `store` (None: a temp SQLite
    /// file) and `redis` URLs.
    ///
    /// # Errors
    /// `Options` for an unsupported URL or an existing SQLite file; `Sql`
    /// when the database cannot be created.
    pub(crate) async fn prepare(store: Option<&str>, redis: Option<&str>) -> Result<Self> {
        let suffix = random_suffix()?;
        let mut target = match store.filter(|s| !matches!(*s, "sqlite" | "sqlite:" | "sqlite://")) {
            None => {
                let dir = tempfile::Builder::new()
                    .prefix("agentgate-bench-")
                    .tempdir()
                    .map_err(|e| BenchError::io("cannot create a temp directory", e))?;
                let path = dir.path().join("bench.db");
                Self::sqlite(path, "sqlite (temp file)".to_owned(), Owned::TempDir(dir))
            }
            Some(url) => match Dialect::of(url)? {
                Dialect::Sqlite => {
                    let path = PathBuf::from(
                        url.trim_start_matches("sqlite://")
                            .trim_start_matches("sqlite:"),
                    );
                    if path.exists() {
                        return Err(BenchError::Options(format!(
                            "{} exists; the bench writes only to a file it creates",
                            path.display()
                        )));
                    }
                    let label = format!("sqlite ({})", path.display());
                    Self::sqlite(path.clone(), label, Owned::SqliteFile(path))
                }
                dialect => Self::server_database(dialect, url, &suffix).await?,
            },
        };
        if let Some(redis) = redis {
            let prefix = format!("agentgate-bench-{suffix}:");
            let base = Url::parse(redis)?.without_param("key_prefix");
            target.redis_url = Some(base.with_param("key_prefix", &prefix).to_url_string());
            target.redis_base_url = Some(base.to_url_string());
            target.label = format!("{} + redis ({})", target.label, base.redacted());
            target.redis_prefix = Some(prefix);
        }
        Ok(target)
    }

    fn sqlite(path: PathBuf, label: String, owned: Owned) -> Self {
        Self {
            dialect: Dialect::Sqlite,
            store_url: format!("sqlite://{}", path.display()),
            redis_url: None,
            redis_base_url: None,
            redis_prefix: None,
            label,
            owned,
        }
    }

    async fn server_database(dialect: Dialect, url: &str, suffix: &str) -> Result<Self> {
        let admin = Url::parse(url)?;
        let name = format!("agentgate_bench_{suffix}");
        match dialect {
            Dialect::Postgres => {
                let mut conn = sqlx::PgConnection::connect(&admin.to_url_string()).await?;
                conn.execute(format!("CREATE DATABASE {name}").as_str())
                    .await?;
                conn.close().await?;
            }
            Dialect::MySql => {
                let admin_url = admin.with_scheme("mysql").to_url_string();
                let mut conn = sqlx::MySqlConnection::connect(&admin_url).await?;
                conn.execute(
                    format!("CREATE DATABASE {name} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")
                        .as_str(),
                )
                .await?;
                conn.close().await?;
            }
            Dialect::Sqlite => unreachable!("a SQLite target is a file"),
        }
        let store = admin.with_database(&name);
        Ok(Self {
            dialect,
            store_url: store.to_url_string(),
            redis_url: None,
            redis_base_url: None,
            redis_prefix: None,
            label: format!("{} (database {name})", admin.with_database("").redacted()),
            owned: Owned::Database {
                admin_url: admin.to_url_string(),
                name,
            },
        })
    }

    /// Removes the file, database and Redis keys the run created. Runs every
    /// step even when an earlier one fails, and reports the first failure.
    ///
    /// # Errors
    /// The first step that failed.
    pub(crate) async fn cleanup(self) -> Result<()> {
        let mut first_error = None;
        if let (Some(base), Some(prefix)) = (&self.redis_base_url, &self.redis_prefix) {
            if let Err(error) = delete_prefix(base, prefix).await {
                first_error.get_or_insert(error);
            }
        }
        let dropped = match self.owned {
            Owned::TempDir(dir) => dir
                .close()
                .map_err(|e| BenchError::io("cannot remove the temp directory", e)),
            Owned::SqliteFile(path) => remove_sqlite_files(&path),
            Owned::Database { admin_url, name } => drop_database(self.dialect, &admin_url, &name)
                .await
                .map_err(|error| {
                    tracing::error!(%error, database = %name, "could not drop the bench database; drop it by hand");
                    error
                }),
        };
        if let Err(error) = dropped {
            first_error.get_or_insert(error);
        }
        first_error.map_or(Ok(()), Err)
    }
}

fn remove_sqlite_files(path: &std::path::Path) -> Result<()> {
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut file = path.as_os_str().to_owned();
        file.push(suffix);
        match std::fs::remove_file(&file) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => {
                return Err(BenchError::io(
                    format!("cannot remove {}", PathBuf::from(file).display()),
                    error,
                ))
            }
        }
    }
    Ok(())
}

async fn drop_database(dialect: Dialect, admin_url: &str, name: &str) -> Result<()> {
    match dialect {
        Dialect::Postgres => {
            let mut conn = sqlx::PgConnection::connect(admin_url).await?;
            // FORCE ends connections a killed child server may have left.
            conn.execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
                .await?;
            conn.close().await?;
        }
        Dialect::MySql => {
            let admin_url = Url::parse(admin_url)?.with_scheme("mysql").to_url_string();
            let mut conn = sqlx::MySqlConnection::connect(&admin_url).await?;
            conn.execute(format!("DROP DATABASE IF EXISTS {name}").as_str())
                .await?;
            conn.close().await?;
        }
        Dialect::Sqlite => {}
    }
    Ok(())
}

/// Deletes every key under `prefix`, in bounded batches.
async fn delete_prefix(base_url: &str, prefix: &str) -> Result<()> {
    let client = redis::Client::open(base_url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let pattern = format!("{prefix}*");
    let mut cursor: u64 = 0;
    for _ in 0..MAX_REDIS_SCAN_CALLS {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(REDIS_SCAN_BATCH)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            let _: i64 = redis::cmd("UNLINK")
                .arg(&keys)
                .query_async(&mut conn)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
    Err(BenchError::unexpected(format!(
        "more than {MAX_REDIS_SCAN_CALLS} SCAN calls under {prefix}; delete the rest by hand"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dialects_by_scheme() {
        assert_eq!(Dialect::of("sqlite://x.db").unwrap(), Dialect::Sqlite);
        assert_eq!(Dialect::of("postgresql://h/db").unwrap(), Dialect::Postgres);
        assert_eq!(Dialect::of("mariadb://h/db").unwrap(), Dialect::MySql);
        assert!(Dialect::of("oracle://h/db").is_err());
    }

    #[tokio::test]
    async fn an_existing_sqlite_file_is_refused_and_a_temp_one_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let existing = dir.path().join("user.db");
        std::fs::write(&existing, b"user data").unwrap();
        let url = format!("sqlite://{}", existing.display());
        assert!(Target::prepare(Some(&url), None).await.is_err());
        assert_eq!(std::fs::read(&existing).unwrap(), b"user data");

        let target = Target::prepare(None, None).await.unwrap();
        let path = PathBuf::from(target.store_url.trim_start_matches("sqlite://"));
        std::fs::write(&path, b"x").unwrap();
        target.cleanup().await.unwrap();
        assert!(!path.exists());
    }
}
