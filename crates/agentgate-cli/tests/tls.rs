//! TLS to every store, for real: a throw-away CA and server certificate
//! (rcgen), then private PostgreSQL, Redis and MariaDB servers on free
//! loopback ports that accept TLS only, and agentgate opened through them as
//! the shipping binary opens them (`Gate::connect`, default features).
//!
//! Each test asserts the refusals too: plaintext refused by the server, a
//! certificate from another CA and a host name the certificate does not name
//! refused by the client. The server certificate names `localhost` only, so
//! `127.0.0.1` passes `verify-ca` but not `verify-full`.
//!
//! Skipped with a printed reason when a server's binaries are absent, unless
//! `AGENTGATE_REQUIRE_SERVICES=1`. Tests run as root, so the database
//! servers run as their Debian users through `runuser`; the machine's own
//! clusters are never touched.

use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agentgate::{Begun, Config, ErrorKind, Gate};
use agentgate_conformance::targets::absent;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use serde_json::json;

/// How long a started server may take to accept connections. Each starts
/// in a second or two on an idle machine; twenty allows for a loaded one.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(20);

/// What `verify-ca` / `VERIFY_CA` answers for a certificate that does not
/// name the host: libpq and the MySQL client accept it, but sqlx 0.8.6 with
/// rustls 0.23.24 or newer refuses it like `verify-full` (sqlx issue 3793:
/// its name-blind verifier misses rustls's `NotValidForNameContext`; fixed
/// after 0.8.6). Failing closed is safe. When a sqlx upgrade makes this
/// test fail here, `verify-ca` has become name-blind: assert that the
/// connection succeeds and drop the caveat from docs/http.md.
const SQLX_VERIFY_CA_CHECKS_NAME: &str = "certificate not valid for name";

/// Files of one throw-away PKI, in a directory the servers' users can read.
struct Pki {
    /// The CA that signed the server and client certificates.
    ca: PathBuf,
    /// Another CA, which signed nothing the servers present.
    other_ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    /// A client certificate for the user `postgres` (PostgreSQL's
    /// `clientcert=verify-full` compares its CN with the user name).
    client_cert: PathBuf,
    client_key: PathBuf,
}

fn ca(name: &str) -> (rcgen::Certificate, KeyPair) {
    let key = KeyPair::generate().expect("a CA key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    (params.self_signed(&key).expect("a CA certificate"), key)
}

fn leaf(
    names: Vec<String>,
    common_name: &str,
    usage: ExtendedKeyUsagePurpose,
    issuer: &(rcgen::Certificate, KeyPair),
) -> (String, String) {
    let key = KeyPair::generate().expect("a leaf key");
    let mut params = CertificateParams::new(names).expect("leaf params");
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.extended_key_usages = vec![usage];
    let cert = params
        .signed_by(&key, &issuer.0, &issuer.1)
        .expect("a signed certificate");
    (cert.pem(), key.serialize_pem())
}

impl Pki {
    fn create(dir: &Path) -> Self {
        let signer = ca("agentgate test CA");
        let (other, _) = ca("agentgate other CA");
        let server = leaf(
            vec!["localhost".to_owned()],
            "localhost",
            ExtendedKeyUsagePurpose::ServerAuth,
            &signer,
        );
        let client = leaf(
            Vec::new(),
            "postgres",
            ExtendedKeyUsagePurpose::ClientAuth,
            &signer,
        );
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).expect("write a PKI file");
            // PostgreSQL refuses a key file others can read.
            let owner_only = std::fs::Permissions::from_mode(0o600);
            std::fs::set_permissions(&path, owner_only).expect("chmod a PKI file");
            path
        };
        Self {
            ca: write("ca.crt", &signer.0.pem()),
            other_ca: write("other-ca.crt", &other.pem()),
            server_cert: write("server.crt", &server.0),
            server_key: write("server.key", &server.1),
            client_cert: write("client.crt", &client.0),
            client_key: write("client.key", &client.1),
        }
    }
}

/// A free loopback port (free when asked; the server binds it a moment later).
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    listener.local_addr().expect("local address").port()
}

fn running_as_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// `program args…`, as `user` when the tests run as root (database servers
/// refuse to run as root), else as whoever runs the tests.
fn command_as(user: &str, program: &Path) -> Command {
    if running_as_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", user, "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

/// Runs `command` to its end, panicking with its output on failure.
fn run(mut command: Command, what: &str) {
    let output = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Hands `dir` and everything in it to `user`.
fn give_to(dir: &Path, user: &str) {
    if running_as_root() {
        let mut chown = Command::new("chown");
        chown.arg("-R").arg(format!("{user}:")).arg(dir);
        run(chown, "chown");
    }
}

/// Waits until something accepts TCP connections on `port`.
fn wait_for_port(port: u16, what: &str, log: &Path) {
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "{what} did not listen on {port} within {STARTUP_TIMEOUT:?}: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A begin, then the turn's ending, then the same begin replayed: the store
/// answered over the connection it was opened with.
async fn round(gate: &Gate, session: &str) {
    let payload = json!({"text": "taxi 18"});
    let Begun::Started(turn) = gate
        .begin("tls-user", session, "msg-1", &payload)
        .await
        .expect("begin over TLS")
    else {
        panic!("a fresh session's first begin starts a turn");
    };
    let busy = gate
        .begin("tls-user", session, "msg-2", &payload)
        .await
        .expect_err("the session is held");
    assert_eq!(busy.kind(), ErrorKind::SessionBusy, "{busy}");
    turn.succeed(&json!({"text": "booked"}))
        .await
        .expect("complete over TLS");
    let again = gate
        .begin("tls-user", session, "msg-1", &payload)
        .await
        .expect("replay over TLS");
    assert!(matches!(again, Begun::Replay(_)), "a retry replays");
}

/// Opens `url` expecting a refusal of `kind` whose message contains `needle`.
async fn refused(store: &str, redis: Option<&str>, kind: ErrorKind, needle: &str) {
    let error = Gate::connect(store, redis, Config::default())
        .await
        .expect_err("refused");
    let message = error.to_string();
    assert_eq!(error.kind(), kind, "{message}");
    assert!(message.contains(needle), "{needle:?} not in {message:?}");
}

// ---------------------------------------------------------------- PostgreSQL

/// The newest Debian PostgreSQL's `bin` directory with `initdb` and `pg_ctl`.
fn postgres_bin() -> Option<PathBuf> {
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let version = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            (bin.join("initdb").exists() && bin.join("pg_ctl").exists()).then_some((version, bin))
        })
        .collect();
    dirs.sort();
    dirs.pop().map(|(_, bin)| bin)
}

/// A private PostgreSQL cluster, stopped (immediately) when dropped.
struct Postgres {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
}

impl Postgres {
    /// initdb, a pg_hba.conf that refuses every connection without TLS (and
    /// one without a client certificate to the database `mtls`), then start.
    fn start(dir: &Path, bin: PathBuf, pki: &Pki) -> Self {
        let data = dir.join("data");
        give_to(dir, "postgres");
        let mut initdb = command_as("postgres", &bin.join("initdb"));
        initdb.arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        ]);
        run(initdb, "initdb");
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\n\
             hostssl mtls all 127.0.0.1/32 trust clientcert=verify-full\n\
             hostssl all all 127.0.0.1/32 trust\n\
             hostnossl all all 0.0.0.0/0 reject\n",
        )
        .expect("write pg_hba.conf");
        let port = free_port();
        let settings = format!(
            "-c port={port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={dir} \
             -c ssl=on -c ssl_cert_file={cert} -c ssl_key_file={key} -c ssl_ca_file={ca} \
             -c fsync=off",
            dir = dir.display(),
            cert = pki.server_cert.display(),
            key = pki.server_key.display(),
            ca = pki.ca.display(),
        );
        give_to(dir, "postgres");
        let log = dir.join("postgres.log");
        let mut start = command_as("postgres", &bin.join("pg_ctl"));
        start
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(&log)
            .args(["-w", "-t", "20", "-o", &settings, "start"]);
        let server = Self { bin, data, port };
        run(start, "pg_ctl start");
        wait_for_port(port, "PostgreSQL", &log);
        let mut createdb = command_as("postgres", &server.bin.join("createdb"));
        createdb
            .arg("-h")
            .arg(dir)
            .args(["-p", &port.to_string(), "mtls"]);
        run(createdb, "createdb mtls");
        server
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let mut stop = command_as("postgres", &self.bin.join("pg_ctl"));
        stop.arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let _ = stop.status();
    }
}

#[tokio::test]
async fn postgres_over_verified_tls() {
    let Some(bin) = postgres_bin() else {
        absent::<()>("PostgreSQL binaries", "no /usr/lib/postgresql/*/bin/initdb");
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = Pki::create(dir.path());
    let server = Postgres::start(dir.path(), bin, &pki);
    let port = server.port;
    let ca = pki.ca.display();
    let url = |host: &str, db: &str, query: &str| {
        format!("postgres://postgres:not-a-secret-pw@{host}:{port}/{db}?{query}")
    };

    let verified = url(
        "localhost",
        "postgres",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    let gate = Gate::open(&verified, Config::default())
        .await
        .expect("verify-full against the test CA");
    round(&gate, "pg-tls").await;
    let shown = format!("{gate:?}");
    assert!(!shown.contains("not-a-secret-pw"), "password in {shown}");

    // The certificate names localhost only.
    let by_ip = url(
        "127.0.0.1",
        "postgres",
        &format!("sslmode=verify-ca&sslrootcert={ca}"),
    );
    refused(
        &by_ip,
        None,
        ErrorKind::StoreUnavailable,
        SQLX_VERIFY_CA_CHECKS_NAME,
    )
    .await;
    let wrong_name = url(
        "127.0.0.1",
        "postgres",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    refused(
        &wrong_name,
        None,
        ErrorKind::StoreUnavailable,
        "certificate not valid for name",
    )
    .await;

    let other = pki.other_ca.display();
    let wrong_ca = url(
        "localhost",
        "postgres",
        &format!("sslmode=verify-full&sslrootcert={other}"),
    );
    refused(
        &wrong_ca,
        None,
        ErrorKind::StoreUnavailable,
        "UnknownIssuer",
    )
    .await;

    let plain = url("127.0.0.1", "postgres", "sslmode=disable");
    refused(&plain, None, ErrorKind::StoreUnavailable, "no encryption").await;

    // A client certificate, where the server asks for one.
    let no_client_cert = url("localhost", "mtls", &format!("sslrootcert={ca}"));
    refused(
        &no_client_cert,
        None,
        ErrorKind::StoreUnavailable,
        "requires a valid client certificate",
    )
    .await;
    let client = format!(
        "sslrootcert={ca}&sslcert={}&sslkey={}",
        pki.client_cert.display(),
        pki.client_key.display()
    );
    let gate = Gate::open(&url("localhost", "mtls", &client), Config::default())
        .await
        .expect("a client certificate the server trusts");
    round(&gate, "pg-mtls").await;

    refused(
        &url("localhost", "postgres", "sslmode=verify-fully"),
        None,
        ErrorKind::InvalidRequest,
        "sslmode",
    )
    .await;
}

// --------------------------------------------------------------------- Redis

/// A private `redis-server` listening with TLS only, killed when dropped.
struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    fn start(dir: &Path, pki: &Pki) -> Option<Self> {
        let port = free_port();
        let log = dir.join("redis.log");
        let child = Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--tls-port")
            .arg(port.to_string())
            .arg("--tls-cert-file")
            .arg(&pki.server_cert)
            .arg("--tls-key-file")
            .arg(&pki.server_key)
            .arg("--tls-ca-cert-file")
            .arg(&pki.ca)
            .args([
                "--tls-auth-clients",
                "no",
                "--requirepass",
                "not-a-secret-pw",
            ])
            .arg("--dir")
            .arg(dir)
            .arg("--logfile")
            .arg(&log)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) => return absent("redis-server", e),
        };
        let mut server = Self { child, port };
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = server.child.try_wait() {
                let why = std::fs::read_to_string(&log).unwrap_or_default();
                return absent("redis-server with TLS", format!("exited {status}: {why}"));
            }
            assert!(
                Instant::now() < deadline,
                "redis-server did not listen on {port}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(server)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn redis_lease_layer_over_verified_tls() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = Pki::create(dir.path());
    let Some(server) = Redis::start(dir.path(), &pki) else {
        return;
    };
    let port = server.port;
    let store = format!("sqlite://{}", dir.path().join("records.db").display());
    let redis = |host: &str, ca: &Path| {
        format!(
            "rediss://:not-a-secret-pw@{host}:{port}/0?ca_file={}&key_prefix=tls:",
            ca.display()
        )
    };

    let gate = Gate::connect(
        &store,
        Some(&redis("localhost", &pki.ca)),
        Config::default(),
    )
    .await
    .expect("rediss:// against the test CA");
    round(&gate, "redis-tls").await;
    let shown = format!("{gate:?}");
    assert!(!shown.contains("not-a-secret-pw"), "password in {shown}");

    let wrong_ca = redis("localhost", &pki.other_ca);
    refused(
        &store,
        Some(&wrong_ca),
        ErrorKind::StoreUnavailable,
        "UnknownIssuer",
    )
    .await;
    let wrong_name = redis("127.0.0.1", &pki.ca);
    refused(
        &store,
        Some(&wrong_name),
        ErrorKind::StoreUnavailable,
        "certificate not valid for name",
    )
    .await;
    let plain_with_ca = format!("redis://localhost:{port}/0?ca_file={}", pki.ca.display());
    refused(
        &store,
        Some(&plain_with_ca),
        ErrorKind::InvalidRequest,
        "rediss://",
    )
    .await;
}

// ------------------------------------------------------------------- MariaDB

/// A private `mariadbd` that refuses connections without TLS, stopped when
/// dropped.
struct MariaDb {
    child: Child,
    port: u16,
    pid_file: PathBuf,
}

impl MariaDb {
    fn start(dir: &Path, pki: &Pki) -> Option<Self> {
        let install = Path::new("/usr/bin/mariadb-install-db");
        let daemon = Path::new("/usr/sbin/mariadbd");
        if !install.exists() || !daemon.exists() {
            return absent("MariaDB binaries", "no mariadb-install-db or mariadbd");
        }
        let data = dir.join("data");
        std::fs::write(
            dir.join("init.sql"),
            "CREATE USER 'agent'@'%' IDENTIFIED BY 'not-a-secret-pw' REQUIRE SSL;\n\
             GRANT ALL ON *.* TO 'agent'@'%';\n\
             CREATE DATABASE agentgate;\n",
        )
        .expect("write init.sql");
        give_to(dir, "mysql");
        let mut setup = command_as("mysql", install);
        setup
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .args(["--auth-root-authentication-method=socket", "--skip-test-db"]);
        run(setup, "mariadb-install-db");
        let port = free_port();
        let log = dir.join("mariadb.log");
        let path = |flag: &str, path: &Path| format!("--{flag}={}", path.display());
        let mut command = command_as("mysql", daemon);
        command
            .arg("--no-defaults")
            .arg(path("datadir", &data))
            .arg(path("socket", &dir.join("mariadb.sock")))
            .arg(path("pid-file", &dir.join("mariadb.pid")))
            .arg(path("log-error", &log))
            .arg(path("init-file", &dir.join("init.sql")))
            .arg(path("ssl-cert", &pki.server_cert))
            .arg(path("ssl-key", &pki.server_key))
            .arg(path("ssl-ca", &pki.ca))
            .arg(format!("--port={port}"))
            .args([
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
                "--require-secure-transport=ON",
                "--innodb-buffer-pool-size=16M",
                "--skip-log-bin",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = command.spawn().expect("start mariadbd");
        let pid_file = dir.join("mariadb.pid");
        let server = Self {
            child,
            port,
            pid_file,
        };
        wait_for_port(port, "mariadbd", &log);
        Some(server)
    }
}

impl Drop for MariaDb {
    fn drop(&mut self) {
        // The server's own pid (the child may be runuser): SIGKILL, since
        // the data directory is thrown away with the test.
        if let Ok(pid) = std::fs::read_to_string(&self.pid_file) {
            let _ = Command::new("kill").args(["-KILL", pid.trim()]).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn mariadb_over_verified_tls() {
    let dir = tempfile::tempdir().expect("temp dir");
    let pki = Pki::create(dir.path());
    let Some(server) = MariaDb::start(dir.path(), &pki) else {
        return;
    };
    let port = server.port;
    let url = |host: &str, query: &str| {
        format!("mysql://agent:not-a-secret-pw@{host}:{port}/agentgate?{query}")
    };
    let ca = pki.ca.display();

    let verified = url(
        "localhost",
        &format!("ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}"),
    );
    let gate = Gate::open(&verified, Config::default())
        .await
        .expect("VERIFY_IDENTITY against the test CA");
    round(&gate, "mariadb-tls").await;
    let shown = format!("{gate:?}");
    assert!(!shown.contains("not-a-secret-pw"), "password in {shown}");

    let by_ip = url("127.0.0.1", &format!("ssl-mode=VERIFY_CA&ssl-ca={ca}"));
    refused(
        &by_ip,
        None,
        ErrorKind::StoreUnavailable,
        SQLX_VERIFY_CA_CHECKS_NAME,
    )
    .await;
    let wrong_name = url(
        "127.0.0.1",
        &format!("ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}"),
    );
    refused(
        &wrong_name,
        None,
        ErrorKind::StoreUnavailable,
        "certificate not valid for name",
    )
    .await;
    let other = pki.other_ca.display();
    let wrong_ca = url("localhost", &format!("ssl-ca={other}"));
    refused(
        &wrong_ca,
        None,
        ErrorKind::StoreUnavailable,
        "UnknownIssuer",
    )
    .await;
    // The same user, password and database that just worked over TLS: the
    // server (`REQUIRE SSL`, `require_secure_transport`) answers a plaintext
    // login with MariaDB's one refusal for every login it declines.
    let plain = url("127.0.0.1", "ssl-mode=DISABLED");
    refused(&plain, None, ErrorKind::StoreUnavailable, "1045").await;
    let typo = url("localhost", "ssl-mode=VERIFY-FULL");
    refused(&typo, None, ErrorKind::InvalidRequest, "ssl-mode").await;
}
