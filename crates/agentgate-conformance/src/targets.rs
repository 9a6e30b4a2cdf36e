//! Fresh, empty stores to run the suite against, one kind per backend.
//!
//! A server-backed target whose server is absent skips with a printed reason,
//! unless `AGENTGATE_REQUIRE_SERVICES=1`, which makes absence a failure (CI
//! sets it after starting every server).

use std::any::Any;

use agentgate::{Config, Gate};

/// One fresh store: its URL and whatever keeps it alive (a temp dir).
pub struct Target {
    /// The backend's name, for printed counts.
    pub name: &'static str,
    /// The SQL store's URL.
    pub store_url: String,
    /// The Redis lease layer's URL (with a key prefix of its own), if any.
    pub redis_url: Option<String>,
    _keep: Option<Box<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("name", &self.name)
            .field("store_url", &self.store_url)
            .field("redis_url", &self.redis_url)
            .finish_non_exhaustive()
    }
}

impl Target {
    /// A target at `store_url`, keeping `keep` alive as long as the target.
    pub fn new(
        name: &'static str,
        store_url: String,
        keep: Option<Box<dyn Any + Send + Sync>>,
    ) -> Self {
        Self {
            name,
            store_url,
            redis_url: None,
            _keep: keep,
        }
    }

    /// The same target with the Redis lease layer at `redis_url`.
    #[must_use]
    pub fn with_redis(mut self, name: &'static str, redis_url: String) -> Self {
        self.name = name;
        self.redis_url = Some(redis_url);
        self
    }

    /// Opens a gate on this target with `config`.
    ///
    /// # Panics
    /// When the store cannot be opened: the target was made to be openable.
    pub async fn gate(&self, config: Config) -> Gate {
        Gate::connect(&self.store_url, self.redis_url.as_deref(), config)
            .await
            .unwrap_or_else(|e| panic!("open {} store: {e}", self.name))
    }
}

/// Whether absent servers fail the run instead of skipping.
pub fn services_required() -> bool {
    std::env::var("AGENTGATE_REQUIRE_SERVICES").is_ok_and(|v| v == "1")
}

/// Reports an absent server: panics when services are required, else prints
/// why the test is skipped and returns `None`.
///
/// # Panics
/// When `AGENTGATE_REQUIRE_SERVICES=1`.
pub fn absent<T>(backend: &str, reason: impl std::fmt::Display) -> Option<T> {
    assert!(
        !services_required(),
        "{backend} is required (AGENTGATE_REQUIRE_SERVICES=1) but unavailable: {reason}"
    );
    if crate::run::captured_skip(&format!("{backend} unavailable ({reason})")) {
        return None;
    }
    eprintln!("skipped: {backend} unavailable ({reason}); set AGENTGATE_REQUIRE_SERVICES=1 to fail instead");
    None
}

/// A fresh SQLite file in its own temp dir (a file, not `:memory:`, so
/// several connections and processes share it).
pub async fn sqlite() -> Option<Target> {
    let dir = tempfile::tempdir().expect("a temp dir can be created");
    let url = format!("sqlite://{}", dir.path().join("agentgate.db").display());
    Some(Target::new("sqlite", url, Some(Box::new(dir))))
}

/// The Redis the suite uses: `AGENTGATE_TEST_REDIS_URL`, default local.
fn redis_base_url() -> String {
    std::env::var("AGENTGATE_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379/0".to_owned())
}

/// A Redis URL with a key prefix no other test uses, if Redis answers PING.
pub async fn redis_url() -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let base = redis_base_url();
    let address = base
        .trim_start_matches("redis://")
        .split(['/', '?'])
        .next()
        .unwrap_or("127.0.0.1:6379")
        .to_owned();
    let probe = async {
        let mut stream = tokio::net::TcpStream::connect(&address).await?;
        stream.write_all(b"PING\r\n").await?;
        let mut answer = [0u8; 7];
        stream.read_exact(&mut answer).await?;
        Ok::<_, std::io::Error>(answer.starts_with(b"+PONG"))
    };
    match tokio::time::timeout(std::time::Duration::from_secs(2), probe).await {
        Ok(Ok(true)) => {}
        Ok(Ok(false)) => return absent("redis", format!("{address} did not answer PONG")),
        Ok(Err(error)) => return absent("redis", format!("{address}: {error}")),
        Err(_) => return absent("redis", format!("{address}: timed out")),
    }
    let unique = agentgate::TurnId::generate();
    let separator = if base.contains('?') { '&' } else { '?' };
    Some(format!(
        "{base}{separator}key_prefix=agentgate-test:{unique}:"
    ))
}

/// A fresh SQLite file with the Redis lease layer.
pub async fn sqlite_redis() -> Option<Target> {
    let redis = redis_url().await?;
    let target = sqlite().await?;
    Some(target.with_redis("sqlite+redis", redis))
}

/// A fresh PostgreSQL database, dropped when the target is.
#[cfg(feature = "testing")]
pub async fn postgres() -> Option<Target> {
    let database = agentgate_store_postgres::testing::TestDatabase::create().await?;
    let url = database.url().to_owned();
    Some(Target::new("postgres", url, Some(Box::new(database))))
}

/// A fresh MySQL/MariaDB database, dropped when the target is.
#[cfg(feature = "testing")]
pub async fn mysql() -> Option<Target> {
    let database = agentgate_store_mysql::testing::TestDatabase::create().await?;
    let url = database.url().to_owned();
    Some(Target::new("mysql", url, Some(Box::new(database))))
}

/// A fresh PostgreSQL database with the Redis lease layer.
#[cfg(feature = "testing")]
pub async fn postgres_redis() -> Option<Target> {
    let redis = redis_url().await?;
    Some(postgres().await?.with_redis("postgres+redis", redis))
}

/// A fresh MySQL/MariaDB database with the Redis lease layer.
#[cfg(feature = "testing")]
pub async fn mysql_redis() -> Option<Target> {
    let redis = redis_url().await?;
    Some(mysql().await?.with_redis("mysql+redis", redis))
}
