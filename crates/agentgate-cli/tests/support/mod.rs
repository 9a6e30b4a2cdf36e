//! Test support: start the real `agentgate` binary on a free port with a
//! temp SQLite store, talk to it over HTTP, kill it.

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::HeaderMap;
use serde_json::Value;
use tokio::sync::Barrier;

/// How long a started binary may take to print its address. A debug build
/// opening a fresh SQLite file takes well under a second; ten allows for a
/// loaded CI machine.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(10);

/// A running `agentgate serve`. Killed (SIGKILL) when dropped.
pub struct Server {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub base: String,
    /// The SQLite file, reused by [`Server::restart`] (unused with another store).
    pub store: PathBuf,
    /// The `--store` URL, reused by [`Server::restart`].
    store_url: String,
    /// Where the server's stderr (its logs) goes.
    pub log: PathBuf,
    args: Vec<String>,
    envs: Vec<(String, String)>,
}

/// The binary under test: this build's, or the one `AGENTGATE_TEST_BIN`
/// names (to run a test against an older build, for a before/after count).
pub fn binary() -> PathBuf {
    std::env::var_os("AGENTGATE_TEST_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_agentgate")),
        PathBuf::from,
    )
}

/// A scratch directory that outlives the servers started in it.
pub fn scratch() -> tempfile::TempDir {
    tempfile::tempdir().expect("a temp dir")
}

impl Server {
    /// Starts the binary on a free port with a store in `dir` and `args`.
    pub fn start(dir: &Path, args: &[&str]) -> Self {
        Self::start_with_env(dir, args, &[])
    }

    /// As [`Server::start`], with extra environment variables.
    pub fn start_with_env(dir: &Path, args: &[&str], envs: &[(&str, &str)]) -> Self {
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        let envs = envs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let store = dir.join("agentgate.db");
        let store_url = format!("sqlite://{}", store.display());
        Self::launch(store, store_url, dir.join("server.log"), args, envs)
    }

    /// Starts the binary on a free port on the store at `store_url` (a
    /// shared Postgres or MySQL database, say), logging into `log`.
    pub fn start_on_store(store_url: &str, log: PathBuf, args: &[&str]) -> Self {
        let args = args.iter().map(|a| (*a).to_owned()).collect();
        Self::launch(PathBuf::new(), store_url.to_owned(), log, args, Vec::new())
    }

    /// As [`Server::start_on_store`], with extra environment variables
    /// (`RUST_LOG` among them overrides the default `debug`).
    pub fn start_on_store_with_env(
        store_url: &str,
        log: PathBuf,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> Self {
        let args = args.iter().map(|a| (*a).to_owned()).collect();
        let envs = envs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Self::launch(PathBuf::new(), store_url.to_owned(), log, args, envs)
    }

    fn launch(
        store: PathBuf,
        store_url: String,
        log: PathBuf,
        args: Vec<String>,
        envs: Vec<(String, String)>,
    ) -> Self {
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("open the log file");
        let mut child = Command::new(binary())
            .arg("serve")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--store")
            .arg(&store_url)
            .args(&args)
            .env("RUST_LOG", "debug")
            .envs(envs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .spawn()
            .expect("spawn the agentgate binary");
        let stdout = child.stdout.take().expect("piped stdout");
        let (sender, receiver) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = sender.send(line);
            }
            // Keep draining so the server never blocks on a full pipe.
            for _ in lines {}
        });
        let line = receiver.recv_timeout(STARTUP_TIMEOUT).unwrap_or_else(|_| {
            let _ = child.kill();
            panic!(
                "agentgate did not report its address; log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        });
        let addr = line
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
        Self {
            child,
            base: format!("http://{addr}"),
            store,
            store_url,
            log,
            args,
            envs,
        }
    }

    /// SIGKILLs the server: no graceful shutdown, no cleanup.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts a new server on the same store file with the same flags.
    pub fn restart(&self) -> Self {
        Self::launch(
            self.store.clone(),
            self.store_url.clone(),
            self.log.clone(),
            self.args.clone(),
            self.envs.clone(),
        )
    }

    /// The process id, for sending signals.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the process to exit by itself, up to `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + limit;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Everything the server logged so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A client for this server.
    pub fn client(&self) -> Client {
        Client {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .expect("an HTTP client"),
            base: self.base.clone(),
            bearer: None,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One HTTP answer.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// The headers.
    pub headers: HeaderMap,
    /// The body as JSON (`Value::Null` if it is not JSON).
    pub body: Value,
    /// The body as text.
    pub text: String,
}

impl Reply {
    /// `error.code`, or "" for a success.
    pub fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("")
    }

    /// The `Retry-After` header in seconds.
    pub fn retry_after(&self) -> Option<u64> {
        self.headers
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    }

    /// Asserts the status and, for errors, the code; returns self.
    #[track_caller]
    pub fn expect(self, status: u16, code: &str) -> Self {
        assert_eq!(
            (self.status, self.code()),
            (status, code),
            "unexpected reply: {}",
            self.text
        );
        self
    }

    /// Asserts a conflict with a sane `Retry-After` header and `retry_after_ms`.
    #[track_caller]
    pub fn expect_retry_after(self) -> Self {
        let seconds = self.retry_after().expect("a Retry-After header");
        let millis = self.body["error"]["retry_after_ms"]
            .as_u64()
            .expect("retry_after_ms");
        assert!(seconds >= 1, "Retry-After at least 1 s");
        assert!(millis >= 1);
        assert_eq!(
            seconds,
            millis.div_ceil(1000).max(1),
            "header rounds the ms up"
        );
        self
    }
}

/// An HTTP client for one server.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    bearer: Option<String>,
}

impl Client {
    /// This client, sending `Authorization: Bearer <key>`.
    pub fn with_key(&self, key: &str) -> Self {
        Self {
            bearer: Some(key.to_owned()),
            ..self.clone()
        }
    }

    async fn send(&self, builder: reqwest::RequestBuilder) -> Reply {
        let builder = match &self.bearer {
            Some(key) => builder.bearer_auth(key),
            None => builder,
        };
        let response = builder.send().await.expect("the server answers");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await.expect("a body");
        let body = serde_json::from_str(&text).unwrap_or(Value::Null);
        assert!(
            status < 500 || status == 503,
            "server error {status}: {text}"
        );
        if status >= 400 {
            assert_eq!(
                headers
                    .get("content-type")
                    .map(|v| v.to_str().unwrap_or("")),
                Some("application/json"),
                "errors are JSON: {text}"
            );
            assert!(body["error"]["code"].is_string(), "error body: {text}");
            assert!(body["error"]["message"].is_string(), "error body: {text}");
        }
        Reply {
            status,
            headers,
            body,
            text,
        }
    }

    /// POSTs raw bytes with an optional lease token.
    pub async fn post_raw(
        &self,
        path: &str,
        lease: Option<&str>,
        body: impl Into<reqwest::Body>,
    ) -> Reply {
        let mut builder = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body);
        if let Some(token) = lease {
            builder = builder.header("Lease-Token", token);
        }
        self.send(builder).await
    }

    /// POSTs JSON with an optional lease token.
    pub async fn post(&self, path: &str, lease: Option<&str>, body: &Value) -> Reply {
        self.post_raw(path, lease, body.to_string()).await
    }

    /// GETs a streaming response (Server-Sent Events), resuming after
    /// `last_event_id` when given; the caller reads its body.
    pub async fn get_stream(&self, path: &str, last_event_id: Option<u64>) -> reqwest::Response {
        let mut builder = self.http.get(format!("{}{path}", self.base));
        if let Some(id) = last_event_id {
            builder = builder.header("Last-Event-ID", id.to_string());
        }
        if let Some(key) = &self.bearer {
            builder = builder.bearer_auth(key);
        }
        builder.send().await.expect("the server answers")
    }

    /// GETs `path` with extra headers; the status only.
    pub async fn http_get_with(&self, path: &str, headers: &[(&str, &str)]) -> u16 {
        let mut builder = self.http.get(format!("{}{path}", self.base));
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder
            .send()
            .await
            .expect("the server answers")
            .status()
            .as_u16()
    }

    /// PUTs JSON.
    pub async fn put(&self, path: &str, body: &Value) -> Reply {
        let builder = self
            .http
            .put(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_string());
        self.send(builder).await
    }

    /// GETs a path.
    pub async fn get(&self, path: &str) -> Reply {
        self.send(self.http.get(format!("{}{path}", self.base)))
            .await
    }

    /// Begins a turn.
    pub async fn begin(&self, user: &str, session: &str, request: &str, payload: &Value) -> Reply {
        let body = serde_json::json!({
            "user_id": user, "session_id": session, "client_request_id": request, "payload": payload,
        });
        self.post("/v1/turns", None, &body).await
    }
}

/// The lease of a 201 begin: `(turn_id, lease_token)`.
pub fn lease(reply: &Reply) -> (String, String) {
    assert_eq!(reply.status, 201, "a grant: {}", reply.text);
    let turn = &reply.body["turn"];
    (
        turn["turn_id"].as_str().expect("turn_id").to_owned(),
        turn["lease_token"]
            .as_str()
            .expect("lease_token")
            .to_owned(),
    )
}

/// Runs `count` copies of `call` at once (released together by a barrier)
/// and returns their replies in task order.
pub async fn storm<F, Fut>(count: usize, call: F) -> Vec<Reply>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Reply> + Send + 'static,
{
    let barrier = Arc::new(Barrier::new(count));
    let mut tasks = Vec::with_capacity(count);
    for index in 0..count {
        let barrier = Arc::clone(&barrier);
        let request = call(index);
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            request.await
        }));
    }
    let mut replies = Vec::with_capacity(count);
    for task in tasks {
        replies.push(task.await.expect("a storm task"));
    }
    replies
}

/// How many replies have each `(status, code)`.
pub fn tally(replies: &[Reply]) -> std::collections::BTreeMap<(u16, String), usize> {
    let mut counts = std::collections::BTreeMap::new();
    for reply in replies {
        *counts
            .entry((reply.status, reply.code().to_owned()))
            .or_insert(0) += 1;
    }
    counts
}
