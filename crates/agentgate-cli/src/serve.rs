//! `agentgate serve`: flags (each also an `AGENTGATE_*` environment
//! variable) turned into an [`agentgate_server::ServeConfig`] and the
//! reference app's settings, and the composition of the two: the service
//! (`agentgate_server`) opens the engine, the app (`agentgate_app`) is
//! opened on it and mounted beside `/v1` unless `--no-app`. Everything else
//! lives in those crates.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use agentgate_app::{LedgerConfig, LedgerMount, ModelChoice, OnDisconnect, DEFAULT_THINK_TIME_MS};
use agentgate_server::limits::{DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS};
use agentgate_server::serve::DEFAULT_CONFIRMATION_TTL_MS;

/// `--cancel-grace-ms`'s default: the engine's.
#[allow(clippy::cast_possible_truncation)]
const DEFAULT_CANCEL_GRACE_MS: u64 = agentgate::limits::DEFAULT_CANCEL_GRACE.as_millis() as u64;
use agentgate_server::{read_key_file, shutdown_signal, ApiKey, ServeConfig, Server};

use crate::BoxError;

/// Flags of `agentgate serve`.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// Address to listen on, host:port (port 0 picks a free one). Loopback by
    /// default: set --api-key before listening on a public address.
    #[arg(long, env = "AGENTGATE_LISTEN", default_value = "127.0.0.1:7700")]
    listen: String,
    /// Store URL: sqlite://path (created if missing).
    #[arg(
        long,
        env = "AGENTGATE_STORE",
        default_value = "sqlite://agentgate.db",
        hide_env_values = true
    )]
    store: String,
    /// Redis URL of the lease layer (redis://host:port/db[?key_prefix=...]):
    /// session leases and permits live in Redis, records and fences in the
    /// store.
    #[arg(long, env = "AGENTGATE_REDIS", hide_env_values = true)]
    redis: Option<String>,
    /// Lease TTL in milliseconds; callers heartbeat every third of it.
    #[arg(long, env = "AGENTGATE_LEASE_TTL_MS", default_value_t = 30_000)]
    lease_ttl_ms: u64,
    /// Concurrent live turns per user.
    #[arg(long, env = "AGENTGATE_MAX_TURNS_PER_USER", default_value_t = 5)]
    max_turns_per_user: u32,
    /// How long a pending confirmation waits for the person's answer, in
    /// milliseconds (1 s to 30 days); until then new messages in that
    /// conversation are refused with awaiting_confirmation.
    #[arg(long, env = "AGENTGATE_CONFIRMATION_TTL_MS", default_value_t = DEFAULT_CONFIRMATION_TTL_MS)]
    confirmation_ttl_ms: u64,
    /// How long a running turn asked to stop (POST /v1/turns/{id}/cancel,
    /// or an interrupting message) has to end itself, in milliseconds
    /// (1 s to a day); then the sweeper force-releases it.
    #[arg(long, env = "AGENTGATE_CANCEL_GRACE_MS", default_value_t = DEFAULT_CANCEL_GRACE_MS)]
    cancel_grace_ms: u64,
    /// How long an orphan (a running turn whose lease expired without an
    /// ending) waits for a client's retry or a recovery worker before the
    /// sweeper ends it abandoned, in milliseconds (1 s to a day; never less
    /// than the lease TTL).
    #[arg(long, env = "AGENTGATE_ORPHAN_GRACE_MS", default_value_t = 300_000)]
    orphan_grace_ms: u64,
    /// How often the sweeper runs (abandons orphans past their grace,
    /// force-releases ignored cancels, deletes expired records), in
    /// milliseconds (10 ms to 30 days).
    #[arg(long, env = "AGENTGATE_SWEEP_INTERVAL_MS", default_value_t = 60_000)]
    sweep_interval_ms: u64,
    /// Pooled connections to a PostgreSQL or MySQL store (1 to 200).
    #[arg(long, env = "AGENTGATE_STORE_CONNECTIONS", default_value_t = agentgate::limits::DEFAULT_STORE_CONNECTIONS)]
    store_connections: u32,
    /// API key required as `Authorization: Bearer <key>` on every /v1 call.
    /// Repeatable; in the environment, comma-separated. Prefer
    /// --api-key-file or the environment: flags show in `ps`.
    #[arg(
        long = "api-key",
        env = "AGENTGATE_API_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    api_keys: Vec<String>,
    /// File of API keys, one per line (blank lines and # comments skipped).
    #[arg(long, env = "AGENTGATE_API_KEY_FILE")]
    api_key_file: Option<PathBuf>,
    /// A recovery worker's key: accepted as an API key, and a request with
    /// it may claim any user's orphan even under --user-header. Repeatable;
    /// in the environment, comma-separated.
    #[arg(
        long = "recovery-key",
        env = "AGENTGATE_RECOVERY_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    recovery_keys: Vec<String>,
    /// File of recovery keys, one per line, as --api-key-file.
    #[arg(long, env = "AGENTGATE_RECOVERY_KEY_FILE")]
    recovery_key_file: Option<PathBuf>,
    /// Largest request body in bytes; larger ones get 413.
    #[arg(long, env = "AGENTGATE_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    max_body_bytes: usize,
    /// Serve only the v1 API: no ledger agent at / nor dashboard at /dashboard.
    #[arg(long, env = "AGENTGATE_NO_APP")]
    no_app: bool,
    /// The reference app's model: the built-in offline one, or an
    /// OpenAI-compatible chat endpoint (key from AGENTGATE_MODEL_API_KEY).
    #[arg(long, env = "AGENTGATE_MODEL", value_enum, default_value_t = ModelArg::Offline)]
    model: ModelArg,
    /// With --model openai: the endpoint's base URL (or full
    /// .../chat/completions URL).
    #[arg(long, env = "AGENTGATE_MODEL_URL")]
    model_url: Option<String>,
    /// With --model openai: the model name sent with each request.
    #[arg(long, env = "AGENTGATE_MODEL_NAME")]
    model_name: Option<String>,
    /// The offline model's think time per round in milliseconds (a booking
    /// takes three rounds), to look like a real LLM.
    #[arg(long, env = "AGENTGATE_THINK_TIME_MS", default_value_t = DEFAULT_THINK_TIME_MS)]
    think_time_ms: u64,
    /// Entries above this amount (in yuan) wait for the person's
    /// confirmation before they are booked.
    #[arg(long, env = "AGENTGATE_CONFIRM_THRESHOLD", default_value_t = 1000)]
    confirm_threshold: u64,
    /// When a chat page's event stream disconnects: let the turn finish, or
    /// cancel it. Either way its lease is released.
    #[arg(long, env = "AGENTGATE_ON_DISCONNECT", value_enum, default_value_t = DisconnectArg::Finish)]
    on_disconnect: DisconnectArg,
    /// Most client connections open at once; one over the cap is answered
    /// 503 `overloaded` and closed. Keep it below the process's file
    /// descriptor limit (`ulimit -n`).
    #[arg(long, env = "AGENTGATE_MAX_CONNECTIONS", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// Most connections one client (peer IP address) holds open at once;
    /// more are answered 503 `overloaded`. Behind a reverse proxy, whose
    /// address every client shares, set it to --max-connections.
    #[arg(long, env = "AGENTGATE_MAX_CONNECTIONS_PER_CLIENT", default_value_t = agentgate_server::limits::DEFAULT_MAX_CONNECTIONS_PER_CLIENT)]
    max_connections_per_client: usize,
    /// A Host name this server answers besides IP addresses, `localhost`
    /// and the --listen host (`name`, or `name:port` for that port only);
    /// others are refused 403, against DNS rebinding. Repeatable; in the
    /// environment, comma-separated.
    #[arg(
        long = "allowed-host",
        env = "AGENTGATE_ALLOWED_HOST",
        value_delimiter = ','
    )]
    allowed_hosts: Vec<String>,
    /// An Origin (`https://name[:port]`) whose pages may call this server
    /// besides its own; browsers' requests from others are refused 403.
    /// Repeatable; in the environment, comma-separated.
    #[arg(
        long = "allowed-origin",
        env = "AGENTGATE_ALLOWED_ORIGIN",
        value_delimiter = ','
    )]
    allowed_origins: Vec<String>,
    /// A header (e.g. X-Agentgate-User) a trusted front end sets to the user
    /// it acts for: a request about another user_id is then refused 403
    /// `user_mismatch`, and one without the header 400.
    #[arg(long, env = "AGENTGATE_USER_HEADER")]
    user_header: Option<String>,
}

/// `--model`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum ModelArg {
    /// Built in, deterministic, no network.
    Offline,
    /// An OpenAI-compatible chat-completions endpoint with tool calling.
    Openai,
}

/// `--on-disconnect`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum DisconnectArg {
    /// The turn runs to its end and releases its lease.
    Finish,
    /// The turn is cancelled at its next step and releases its lease.
    Cancel,
}

/// The reference app's settings, when it is served.
struct AppSettings {
    model: ModelChoice,
    confirmation_threshold_cents: i64,
    on_disconnect: OnDisconnect,
}

impl ServeArgs {
    fn into_config(self) -> Result<(ServeConfig, Option<AppSettings>), BoxError> {
        let mut api_keys = self
            .api_keys
            .into_iter()
            .map(ApiKey::new)
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(path) = &self.api_key_file {
            api_keys.extend(read_key_file(path)?);
        }
        let mut recovery_keys = self
            .recovery_keys
            .into_iter()
            .map(ApiKey::new)
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(path) = &self.recovery_key_file {
            recovery_keys.extend(read_key_file(path)?);
        }
        let model = match self.model {
            ModelArg::Offline => ModelChoice::Offline {
                think_time: Duration::from_millis(self.think_time_ms),
            },
            ModelArg::Openai => ModelChoice::OpenAi {
                url: self
                    .model_url
                    .ok_or("--model openai needs --model-url (or AGENTGATE_MODEL_URL)")?,
                name: self
                    .model_name
                    .ok_or("--model openai needs --model-name (or AGENTGATE_MODEL_NAME)")?,
            },
        };
        let confirmation_threshold_cents = i64::try_from(self.confirm_threshold)
            .ok()
            .and_then(|yuan| yuan.checked_mul(100))
            .ok_or("--confirm-threshold is too large")?;
        let app = (!self.no_app).then_some(AppSettings {
            model,
            confirmation_threshold_cents,
            on_disconnect: match self.on_disconnect {
                DisconnectArg::Finish => OnDisconnect::Finish,
                DisconnectArg::Cancel => OnDisconnect::Cancel,
            },
        });
        let config = ServeConfig {
            listen: self.listen,
            store_url: self.store,
            redis_url: self.redis,
            lease_ttl: Duration::from_millis(self.lease_ttl_ms),
            max_turns_per_user: self.max_turns_per_user,
            confirmation_ttl: Duration::from_millis(self.confirmation_ttl_ms),
            cancel_grace: Duration::from_millis(self.cancel_grace_ms),
            orphan_grace: Duration::from_millis(self.orphan_grace_ms),
            sweep_interval: Duration::from_millis(self.sweep_interval_ms),
            store_connections: self.store_connections,
            api_keys,
            recovery_keys,
            max_body_bytes: self.max_body_bytes,
            max_connections: self.max_connections,
            max_connections_per_client: self.max_connections_per_client,
            allowed_hosts: self.allowed_hosts,
            allowed_origins: self.allowed_origins,
            user_header: self.user_header,
        };
        Ok((config, app))
    }
}

/// Runs the service until Ctrl-C or SIGTERM. Prints `listening on ADDR` on
/// stdout once the socket is bound, for scripts and tests that use port 0.
///
/// # Errors
/// When a flag is invalid, the store cannot be opened or the address bound.
pub async fn run(args: ServeArgs) -> Result<(), BoxError> {
    // Uploaded PDFs are parsed in child processes of this binary, so a
    // hostile file can crash, exhaust or stall only its child.
    agentgate_ingest::isolate::use_parser_process(
        agentgate_ingest::isolate::ParserProcess::this_executable()?,
    );
    let shutdown = shutdown_signal();
    let (config, app) = args.into_config()?;
    let mut starting = Server::open(config).await?;
    if let Some(app) = app {
        let ledger = LedgerConfig {
            confirmation_threshold_cents: app.confirmation_threshold_cents,
            ..LedgerConfig::default()
        };
        let mount = LedgerMount::open(
            starting.gate().clone(),
            starting.store_url(),
            &app.model,
            ledger,
            app.on_disconnect,
        )
        .await?;
        starting = starting.mount(mount);
    }
    let server = starting.bind().await?;
    let mut stdout = std::io::stdout();
    writeln!(stdout, "listening on {}", server.local_addr())?;
    stdout.flush()?;
    server.run(shutdown).await?;
    Ok(())
}
