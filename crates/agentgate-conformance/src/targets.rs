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
    /// What `Gate::open` takes.
    pub store_url: String,
    _keep: Option<Box<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("name", &self.name)
            .field("store_url", &self.store_url)
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
            _keep: keep,
        }
    }

    /// Opens a gate on this target with `config`.
    ///
    /// # Panics
    /// When the store cannot be opened: the target was made to be openable.
    pub async fn gate(&self, config: Config) -> Gate {
        Gate::open(&self.store_url, config)
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
