//! The engine over HTTP: the same four steps through `agentgate serve` on
//! loopback, with one keep-alive `reqwest` client; the server's life (the
//! real binary as a child process, or in this process when no binary is
//! known); and its peak RSS while many turns are live.

use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use reqwest::StatusCode;
use serde::Deserialize;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::error::{BenchError, Result};
use crate::library::{Bodies, TOOL};
use crate::limits::{
    HTTP_TIMEOUT, LIVE_LEASE_TTL, LIVE_TURN_CLIENTS, SERVER_MAX_CONNECTIONS, SERVER_STARTUP_TIMEOUT,
};
use crate::report::Memory;
use crate::workload::{next_request, session_of, timed, user_of, TurnLoop, STEPS};

/// How `agentgate serve` is started.
#[derive(Clone, Debug)]
pub(crate) struct ServerSpec {
    /// The store URL (the run's own).
    pub store_url: String,
    /// The Redis lease layer's URL, if any.
    pub redis_url: Option<String>,
    /// The lease TTL the server grants.
    pub lease_ttl: Duration,
    /// The per-user cap.
    pub max_turns_per_user: u32,
}

/// A running `agentgate serve`; stopped when dropped.
#[derive(Debug)]
pub(crate) struct RunningServer {
    /// `http://127.0.0.1:PORT`
    pub base: String,
    kind: ServerKind,
}

#[derive(Debug)]
enum ServerKind {
    /// A child process (killed on drop).
    Process(Child),
    /// A task in this process, stopped by dropping the sender.
    InProcess(tokio::sync::oneshot::Sender<()>),
}

impl RunningServer {
    /// Starts the binary at `binary` (`agentgate`) or, without one, the
    /// server in this process.
    ///
    /// # Errors
    /// `Io` when the binary cannot be started or does not report its
    /// address in time; `Engine`-side failures as `Unexpected`.
    pub(crate) async fn start(binary: Option<&Path>, spec: &ServerSpec) -> Result<Self> {
        match binary {
            Some(binary) => Self::spawn(binary, spec).await,
            None => Self::in_process(spec).await,
        }
    }

    async fn spawn(binary: &Path, spec: &ServerSpec) -> Result<Self> {
        let mut command = Command::new(binary);
        command
            .arg("serve")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--store")
            .arg(&spec.store_url)
            .arg("--lease-ttl-ms")
            .arg(spec.lease_ttl.as_millis().to_string())
            .arg("--max-turns-per-user")
            .arg(spec.max_turns_per_user.to_string());
        if let Some(redis) = &spec.redis_url {
            command.arg("--redis").arg(redis);
        }
        // A clean environment: no AGENTGATE_API_KEY or other setting of the
        // caller's leaks into the server; the product's default log level.
        // The cap as an environment variable, not a flag: binaries from
        // before the cap existed (compared in BENCHMARKS.md) ignore it.
        command
            .env_clear()
            .env("RUST_LOG", "info")
            .env(
                "AGENTGATE_MAX_CONNECTIONS",
                SERVER_MAX_CONNECTIONS.to_string(),
            )
            // The bench is one client (one address) by design: all of the
            // cap is its own.
            .env(
                "AGENTGATE_MAX_CONNECTIONS_PER_CLIENT",
                SERVER_MAX_CONNECTIONS.to_string(),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let mut child = command
            .spawn()
            .map_err(|e| BenchError::io(format!("cannot start {}", binary.display()), e))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| BenchError::unexpected("the server's stdout is not piped"))?;
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(SERVER_STARTUP_TIMEOUT, lines.next_line())
            .await
            .map_err(|_| {
                BenchError::unexpected("agentgate serve did not report its address in time")
            })?
            .map_err(|e| BenchError::io("cannot read the server's stdout", e))?
            .ok_or_else(|| BenchError::unexpected("agentgate serve exited before listening"))?;
        let addr = first
            .strip_prefix("listening on ")
            .ok_or_else(|| BenchError::unexpected(format!("agentgate serve printed {first:?}")))?
            .to_owned();
        // Keep draining stdout so the server never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self {
            base: format!("http://{addr}"),
            kind: ServerKind::Process(child),
        })
    }

    async fn in_process(spec: &ServerSpec) -> Result<Self> {
        let config = agentgate_server::ServeConfig {
            listen: "127.0.0.1:0".to_owned(),
            store_url: spec.store_url.clone(),
            redis_url: spec.redis_url.clone(),
            lease_ttl: spec.lease_ttl,
            max_turns_per_user: spec.max_turns_per_user,
            max_connections: SERVER_MAX_CONNECTIONS,
            // One client (one address) by design: all of the cap is its own.
            max_connections_per_client: SERVER_MAX_CONNECTIONS,
            ..agentgate_server::ServeConfig::default()
        };
        let server = agentgate_server::Server::bind(config)
            .await
            .map_err(|e| BenchError::unexpected(format!("cannot start the server: {e}")))?;
        let base = format!("http://{}", server.local_addr());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            if let Err(error) = server
                .run(async {
                    let _ = stopped.await;
                })
                .await
            {
                tracing::error!(%error, "in-process server failed");
            }
        });
        Ok(Self {
            base,
            kind: ServerKind::InProcess(stop),
        })
    }

    /// The child's process id; `None` in process.
    pub(crate) fn pid(&self) -> Option<u32> {
        match &self.kind {
            ServerKind::Process(child) => child.id(),
            ServerKind::InProcess(_) => None,
        }
    }

    /// Stops the server and waits for it.
    pub(crate) async fn stop(self) {
        match self.kind {
            ServerKind::Process(mut child) => {
                let _ = child.kill().await;
            }
            ServerKind::InProcess(stop) => drop(stop),
        }
    }
}

/// A keep-alive client with room for `connections` idle connections.
///
/// # Errors
/// `Http` when the client cannot be built.
pub(crate) fn client(connections: usize) -> Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .timeout(HTTP_TIMEOUT)
        .pool_max_idle_per_host(connections)
        .tcp_nodelay(true)
        .build()?)
}

#[derive(Deserialize)]
struct Granted {
    turn: GrantedTurn,
}

#[derive(Deserialize)]
struct GrantedTurn {
    turn_id: String,
    lease_token: String,
}

#[derive(Deserialize)]
struct Claimed {
    execute: bool,
    execution: ClaimedExecution,
}

#[derive(Deserialize)]
struct ClaimedExecution {
    execution_id: String,
}

/// A turn's lease as the HTTP contract hands it out.
#[derive(Debug)]
pub(crate) struct HttpLease {
    pub turn_id: String,
    pub lease_token: String,
}

/// Begins a turn over HTTP; `Ok(Err(status, code))` for a refusal.
///
/// # Errors
/// `Http` when the call fails; `Unexpected` for a 2xx without a grant.
pub(crate) async fn begin(
    client: &reqwest::Client,
    base: &str,
    user: &str,
    session: &str,
    request: &str,
    payload: &serde_json::Value,
) -> Result<std::result::Result<HttpLease, (u16, String)>> {
    let response = client
        .post(format!("{base}/v1/turns"))
        .json(&json!({
            "user_id": user, "session_id": session, "client_request_id": request, "payload": payload,
        }))
        .send()
        .await?;
    let status = response.status();
    if status == StatusCode::CREATED {
        let granted: Granted = response.json().await?;
        return Ok(Ok(HttpLease {
            turn_id: granted.turn.turn_id,
            lease_token: granted.turn.lease_token,
        }));
    }
    let body: serde_json::Value = response.json().await.unwrap_or_default();
    let code = body["error"]["code"]
        .as_str()
        .unwrap_or(if status.is_success() { "replay" } else { "?" })
        .to_owned();
    Ok(Err((status.as_u16(), code)))
}

/// POSTs `body` with the lease token and expects `expected`.
async fn post_leased(
    client: &reqwest::Client,
    url: String,
    lease_token: &str,
    body: &serde_json::Value,
    expected: StatusCode,
) -> Result<reqwest::Response> {
    let response = client
        .post(&url)
        .header("Lease-Token", lease_token)
        .json(body)
        .send()
        .await?;
    if response.status() != expected {
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        return Err(BenchError::unexpected(format!(
            "POST {url} answered {status}: {text}"
        )));
    }
    Ok(response)
}

/// Ends a turn over HTTP with `response`.
///
/// # Errors
/// `Http`; `Unexpected` for anything but 200.
pub(crate) async fn succeed(
    client: &reqwest::Client,
    base: &str,
    lease: &HttpLease,
    response: &serde_json::Value,
) -> Result<()> {
    post_leased(
        client,
        format!("{base}/v1/turns/{}/complete", lease.turn_id),
        &lease.lease_token,
        &json!({ "response": response }),
        StatusCode::OK,
    )
    .await
    .map(drop)
}

/// Turns through `agentgate serve`.
#[derive(Debug)]
pub(crate) struct HttpTurns {
    client: reqwest::Client,
    base: String,
    bodies: Bodies,
}

impl HttpTurns {
    pub(crate) fn new(client: reqwest::Client, base: String) -> Self {
        Self {
            client,
            base,
            bodies: Bodies::default(),
        }
    }
}

#[async_trait]
impl TurnLoop for HttpTurns {
    async fn turn(&self, client_index: usize, timings: &mut [Duration; STEPS]) -> Result<()> {
        let [begin_ms, claim_ms, complete_ms, end_ms] = timings;
        let (client, base) = (&self.client, self.base.as_str());
        let request = format!("r{}", next_request());
        let began = timed(
            begin_ms,
            begin(
                client,
                base,
                &user_of(client_index),
                &session_of(client_index),
                &request,
                &self.bodies.payload,
            ),
        )
        .await?;
        let lease = began.map_err(|(status, code)| {
            BenchError::unexpected(format!("begin answered {status} {code}"))
        })?;
        let claimed: Claimed = timed(claim_ms, async {
            post_leased(
                client,
                format!("{base}/v1/turns/{}/tools", lease.turn_id),
                &lease.lease_token,
                &json!({"tool": TOOL, "args": self.bodies.args}),
                StatusCode::CREATED,
            )
            .await?
            .json::<Claimed>()
            .await
            .map_err(BenchError::from)
        })
        .await?;
        if !claimed.execute {
            return Err(BenchError::unexpected("a new tool call was cached"));
        }
        timed(
            complete_ms,
            post_leased(
                client,
                format!(
                    "{base}/v1/turns/{}/tools/{}/complete",
                    lease.turn_id, claimed.execution.execution_id
                ),
                &lease.lease_token,
                &json!({"result": self.bodies.result}),
                StatusCode::OK,
            ),
        )
        .await?;
        timed(end_ms, succeed(client, base, &lease, &self.bodies.response)).await?;
        Ok(())
    }
}

/// Peak and current resident set of process `pid`, in KiB (`VmHWM`,
/// `VmRSS` of `/proc/<pid>/status`).
///
/// # Errors
/// `Io` when the file cannot be read (not Linux, or the process is gone).
pub(crate) fn memory_kib(pid: u32) -> Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| BenchError::io(format!("cannot read /proc/{pid}/status"), e))?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse::<u64>().ok())
            .ok_or_else(|| BenchError::unexpected(format!("no {name} in /proc/{pid}/status")))
    };
    Ok((field("VmHWM:")?, field("VmRSS:")?))
}

/// Starts a fresh `agentgate serve` (the binary at `binary`) on the run's
/// store, begins `live_turns` turns on distinct sessions and users without
/// ending them, and reads the server's peak RSS with all of them live.
///
/// The server grants [`LIVE_LEASE_TTL`] leases, so the first turn is still
/// live when the last is begun; its heartbeats are the callers' job, so a
/// live turn costs the server nothing but its store rows.
///
/// # Errors
/// When the server cannot be started, a begin is refused, or `/proc` cannot
/// be read.
pub(crate) async fn live_turns_memory(
    binary: &Path,
    spec: &ServerSpec,
    live_turns: usize,
) -> Result<Memory> {
    let spec = ServerSpec {
        lease_ttl: LIVE_LEASE_TTL,
        ..spec.clone()
    };
    let server = RunningServer::start(Some(binary), &spec).await?;
    let pid = server
        .pid()
        .ok_or_else(|| BenchError::unexpected("the memory server has no process id"))?;
    let client = client(LIVE_TURN_CLIENTS)?;
    let next = Arc::new(AtomicUsize::new(0));
    let payload = Bodies::default().payload;
    let started = Instant::now();
    let mut tasks = JoinSet::new();
    for _ in 0..LIVE_TURN_CLIENTS.min(live_turns) {
        let (client, base, next, payload) = (
            client.clone(),
            server.base.clone(),
            Arc::clone(&next),
            payload.clone(),
        );
        tasks.spawn(async move {
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                if index >= live_turns {
                    return Ok::<_, BenchError>(());
                }
                let user = format!("bench-live-u{index}");
                let session = format!("bench-live-s{index}");
                begin(&client, &base, &user, &session, "r1", &payload)
                    .await?
                    .map_err(|(status, code)| {
                        BenchError::unexpected(format!("live begin answered {status} {code}"))
                    })?;
            }
        });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.map_err(|e| BenchError::unexpected(format!("a live-turn client failed: {e}")))??;
    }
    let begin_s = started.elapsed().as_secs_f64();
    let (peak_kib, rss_kib) = memory_kib(pid)?;
    server.stop().await;
    Ok(Memory {
        live_turns,
        peak_rss_mib: peak_kib as f64 / 1024.0,
        rss_mib: rss_kib as f64 / 1024.0,
        begin_s,
    })
}
