//! Shared helpers of the ledger's integration tests: a temp SQLite store, an
//! app over it, SQL counts, and test models.
#![allow(dead_code)] // Each test file uses a different subset.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agentgate::{Config, Gate};
use agentgate_ledger::model::{DeltaSink, Message, ModelError, ModelReply, ModelRequest};
use agentgate_ledger::{
    event_channel, AgentEvent, EventSender, LedgerApp, LedgerConfig, Model, OfflineModel,
    UserMessage,
};
use async_trait::async_trait;
use sqlx::Connection;
use tokio::sync::mpsc;

/// A temp directory holding one SQLite store.
pub struct Store {
    pub dir: tempfile::TempDir,
    pub url: String,
}

pub fn store() -> Store {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("ledger.db").display());
    Store { dir, url }
}

/// A lease short enough that an abandoned turn is taken over quickly.
pub const SHORT_TTL: Duration = Duration::from_millis(600);

pub async fn app_on(url: &str, engine: Config, model: Arc<dyn Model>) -> LedgerApp {
    let gate = Gate::open(url, engine).await.expect("open gate");
    LedgerApp::open(gate, url, model, LedgerConfig::default())
        .await
        .expect("open app")
}

/// An app with the instant offline model and default settings.
pub async fn offline_app(url: &str) -> LedgerApp {
    app_on(
        url,
        Config::default(),
        Arc::new(OfflineModel::new(Duration::ZERO)),
    )
    .await
}

pub fn message(session: &str, request: &str, text: &str) -> UserMessage {
    UserMessage {
        user_id: "alice".into(),
        session_id: session.into(),
        client_request_id: request.into(),
        text: text.into(),
        utc_offset_minutes: None,
        on_busy: agentgate::OnBusy::REJECT,
    }
}

/// Ledger rows, counted in SQL (not through the app).
pub async fn count_entries(url: &str) -> i64 {
    scalar(url, "SELECT COUNT(*) FROM ledger_entries").await
}

pub async fn scalar(url: &str, sql: &str) -> i64 {
    let mut conn = sqlx::SqliteConnection::connect(url).await.expect("connect");
    sqlx::query_scalar(sql)
        .fetch_one(&mut conn)
        .await
        .expect("query")
}

/// A channel and a function draining what was sent so far.
pub fn events() -> (EventSender, mpsc::Receiver<AgentEvent>) {
    event_channel()
}

pub fn drain(receiver: &mut mpsc::Receiver<AgentEvent>) -> Vec<AgentEvent> {
    let mut all = Vec::new();
    while let Ok(event) = receiver.try_recv() {
        all.push(event);
    }
    all
}

pub fn names(events: &[AgentEvent]) -> Vec<&'static str> {
    events.iter().map(AgentEvent::name).collect()
}

/// Wraps a model and counts its rounds.
#[derive(Debug)]
pub struct Counting {
    pub inner: Arc<dyn Model>,
    pub rounds: AtomicUsize,
}

impl Counting {
    pub fn offline() -> Arc<Self> {
        Arc::new(Self {
            inner: Arc::new(OfflineModel::new(Duration::ZERO)),
            rounds: AtomicUsize::new(0),
        })
    }

    pub fn rounds(&self) -> usize {
        self.rounds.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl Model for Counting {
    fn name(&self) -> &str {
        "counting"
    }

    async fn complete(
        &self,
        request: ModelRequest<'_>,
        deltas: DeltaSink<'_>,
    ) -> Result<ModelReply, ModelError> {
        self.rounds.fetch_add(1, Ordering::SeqCst);
        self.inner.complete(request, deltas).await
    }
}

/// The offline model, except that once a `create_transaction` result is in
/// the conversation (the entry is booked) it reports on `booked` and then
/// thinks forever: a worker that dies after the booking committed.
#[derive(Debug)]
pub struct HangAfterBooking {
    pub booked: tokio::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

impl HangAfterBooking {
    pub fn new() -> (Arc<Self>, tokio::sync::oneshot::Receiver<()>) {
        let (sender, receiver) = tokio::sync::oneshot::channel();
        (
            Arc::new(Self {
                booked: tokio::sync::Mutex::new(Some(sender)),
            }),
            receiver,
        )
    }
}

#[async_trait]
impl Model for HangAfterBooking {
    fn name(&self) -> &str {
        "hang-after-booking"
    }

    async fn complete(
        &self,
        request: ModelRequest<'_>,
        deltas: DeltaSink<'_>,
    ) -> Result<ModelReply, ModelError> {
        let booked = request.messages.iter().any(|m| {
            matches!(m, Message::Tool { name, content, .. } if name == "create_transaction" && content.contains("\"ok\":true"))
        });
        if booked {
            if let Some(sender) = self.booked.lock().await.take() {
                let _ = sender.send(());
            }
            std::future::pending::<()>().await;
        }
        OfflineModel::new(Duration::ZERO)
            .complete(request, deltas)
            .await
    }
}

/// A model that answers each round from a script, recording what it saw.
#[derive(Debug)]
pub struct Scripted {
    pub replies: std::sync::Mutex<Vec<ModelReply>>,
    pub seen: std::sync::Mutex<Vec<Vec<Message>>>,
}

impl Scripted {
    pub fn new(mut replies: Vec<ModelReply>) -> Arc<Self> {
        replies.reverse();
        Arc::new(Self {
            replies: std::sync::Mutex::new(replies),
            seen: std::sync::Mutex::new(Vec::new()),
        })
    }
}

#[async_trait]
impl Model for Scripted {
    fn name(&self) -> &str {
        "scripted"
    }

    async fn complete(
        &self,
        request: ModelRequest<'_>,
        deltas: DeltaSink<'_>,
    ) -> Result<ModelReply, ModelError> {
        self.seen
            .lock()
            .expect("lock")
            .push(request.messages.to_vec());
        let reply = self
            .replies
            .lock()
            .expect("lock")
            .pop()
            .ok_or_else(|| ModelError::Protocol("script ran out".into()))?;
        if !reply.text.is_empty() {
            deltas(&reply.text);
        }
        Ok(reply)
    }
}

/// A worker that dies: its own runtime (its own "process"), running the
/// chat `("s1", "m1", "午饭 35")` with a model that hangs once the booking
/// committed, killed with everything on it (watchdog, turn, the
/// drop-release) by [`DoomedWorker::kill`].
pub struct DoomedWorker {
    kill: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl DoomedWorker {
    /// Starts it on the store at `url`; returns once its booking committed.
    pub async fn booked(url: &str, config: Config) -> Self {
        let (booked_sender, booked) = tokio::sync::oneshot::channel();
        let (kill, killed) = tokio::sync::oneshot::channel::<()>();
        let url = url.to_owned();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let (model, hung) = HangAfterBooking::new();
                let app = app_on(&url, config, model).await;
                tokio::spawn(async move {
                    let _ = app
                        .chat(
                            &message("s1", "m1", "午饭 35"),
                            None,
                            tokio_util::sync::CancellationToken::new(),
                        )
                        .await;
                });
                hung.await.expect("booked");
                let _ = booked_sender.send(());
                let _ = killed.await;
            });
            runtime.shutdown_background();
        });
        booked.await.expect("the worker booked");
        Self { kill, thread }
    }

    /// Kills it: its runtime is dropped with its tasks unfinished.
    pub fn kill(self) {
        let _ = self.kill.send(());
        self.thread.join().expect("worker thread");
    }
}
