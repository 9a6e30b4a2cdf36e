//! The lease holder run as a child process (by `agentgate-holder` and by
//! `agentgate hold`): begins a turn, claims a tool, prints
//! `HOLDING <turn_id> <fence>`, then holds the lease, its watchdog renewing
//! it, until the process is killed.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::time::Duration;

use agentgate::{Begun, BoxError, Config, Gate, ToolStep};
use serde_json::json;

/// How to start the holder process: a program, the arguments before the
/// holder's own (`hold` for `agentgate hold`), and extra environment.
#[derive(Clone, Debug)]
pub struct Holder {
    program: PathBuf,
    leading: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
}

impl Holder {
    /// The holder is `program` itself (the tests' `agentgate-holder`).
    pub fn new(program: impl Into<PathBuf>) -> Self {
        Self {
            program: program.into(),
            leading: Vec::new(),
            env: Vec::new(),
        }
    }

    /// The same holder with `args` before the holder's own arguments.
    #[must_use]
    pub fn with_args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.leading.extend(args.into_iter().map(Into::into));
        self
    }

    /// The same holder with `key=value` in its environment.
    #[must_use]
    pub fn with_env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// A command starting the holder; its own arguments are still to add.
    pub fn command(&self) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.program);
        command.args(&self.leading).envs(self.env.iter().cloned());
        command
    }

    /// A command starting the holder under `wrapper` (e.g. `faketime -f
    /// +1d`); the holder's own arguments are still to add.
    pub fn command_under(
        &self,
        wrapper: impl AsRef<OsStr>,
        wrapper_args: &[&str],
    ) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(wrapper);
        command
            .args(wrapper_args)
            .arg(&self.program)
            .args(&self.leading)
            .envs(self.env.iter().cloned());
        command
    }
}

/// Holds a lease on `session` for `request` until killed.
///
/// # Errors
/// When the store cannot be opened, the request was already answered, or the
/// lease is lost while holding.
pub async fn hold(
    store_url: &str,
    redis_url: Option<&str>,
    user: &str,
    session: &str,
    request: &str,
    lease_ttl: Duration,
) -> Result<(), BoxError> {
    let config = Config {
        lease_ttl,
        ..Config::default()
    };
    let gate = Gate::connect(store_url, redis_url, config).await?;
    let Begun::Started(turn) = gate
        .begin(user, session, request, &json!({"text": request}))
        .await?
    else {
        return Err("the request was already answered".into());
    };
    let ToolStep::Execute(execution) = turn.tool("book", &json!({"amount": 18})).await? else {
        return Err("the tool was already done".into());
    };
    println!("HOLDING {} {}", turn.id(), turn.fence());
    // Hold the execution and the turn until SIGKILL; the watchdog renews.
    turn.cancellation().cancelled().await;
    drop(execution);
    Err("lease lost while holding".into())
}

/// Parses `<store_url> <redis_url or -> <user> <session> <request> <ttl_ms>`
/// and holds.
///
/// # Errors
/// On bad arguments, or as [`hold`].
pub async fn hold_from_args(args: &[String]) -> Result<(), BoxError> {
    let [store_url, redis_url, user, session, request, ttl_ms] = args else {
        return Err(
            "usage: <store_url> <redis_url or -> <user> <session> <request> <ttl_ms>".into(),
        );
    };
    let redis_url = Some(redis_url.as_str()).filter(|url| *url != "-");
    let ttl = Duration::from_millis(ttl_ms.parse()?);
    hold(store_url, redis_url, user, session, request, ttl).await
}
