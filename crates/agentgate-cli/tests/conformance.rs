//! `agentgate conformance` end to end: the real binary certifies a store in
//! scratch stores it removes, prints one table row per check, and exits 0
//! (all passed), 2 (could not start: fast, one clear line) or 130 (Ctrl-C,
//! after removing its scratch database). A few checks per run (`--only`)
//! keep the time small; the full suite is the conformance crate's tests.
//!
//! PostgreSQL, MySQL and Redis runs skip with a printed reason unless
//! `AGENTGATE_REQUIRE_SERVICES=1`.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::str::FromStr as _;
use std::time::{Duration, Instant};

use agentgate_conformance::targets::absent;
use sqlx::{ConnectOptions as _, Connection as _};

/// Longest a run that cannot start may take: the suite's connect timeout
/// is 5 s; a refused port answers at once.
const CANNOT_START_WITHIN: Duration = Duration::from_secs(4);

fn postgres_url() -> String {
    std::env::var("AGENTGATE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

fn mysql_url() -> String {
    std::env::var("AGENTGATE_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

fn redis_url() -> String {
    std::env::var("AGENTGATE_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379/0".to_owned())
}

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    took: Duration,
}

fn conformance(args: &[&str]) -> Run {
    let started = Instant::now();
    let Output {
        status,
        stdout,
        stderr,
    } = Command::new(env!("CARGO_BIN_EXE_agentgate"))
        .arg("conformance")
        .args(args)
        .output()
        .expect("run agentgate conformance");
    let run = Run {
        code: status.code(),
        stdout: String::from_utf8(stdout).expect("utf-8 stdout"),
        stderr: String::from_utf8(stderr).expect("utf-8 stderr"),
        took: started.elapsed(),
    };
    eprintln!(
        "agentgate conformance {args:?} -> {:?} in {:?}\n--- stdout\n{}--- stderr\n{}",
        run.code, run.took, run.stdout, run.stderr
    );
    run
}

/// The RESULT column of `check`'s row in the table.
fn result_of<'a>(stdout: &'a str, check: &str) -> Option<&'a str> {
    stdout.lines().find_map(|line| {
        let mut columns = line.split_whitespace();
        (columns.next() == Some(check))
            .then(|| columns.next())
            .flatten()
    })
}

/// The run id from the header: `... databases agentgate_conformance_<run>_* ...`
/// or `... Redis keys agentgate-conformance:<run>:* ...`.
fn run_id(stderr: &str) -> String {
    for marker in ["agentgate_conformance_", "agentgate-conformance:"] {
        if let Some(at) = stderr.find(marker) {
            let rest = &stderr[at + marker.len()..];
            let end = rest
                .find(|c: char| !c.is_ascii_hexdigit())
                .unwrap_or(rest.len());
            if end > 0 {
                return rest[..end].to_owned();
            }
        }
    }
    panic!("no run id in the header: {stderr}");
}

/// The scratch dir from a SQLite header: `... files in <dir>`.
fn sqlite_dir(stderr: &str) -> PathBuf {
    let line = stderr
        .lines()
        .find(|l| l.contains(": files in "))
        .unwrap_or_else(|| panic!("no sqlite header: {stderr}"));
    let dir = line.split(": files in ").nth(1).unwrap();
    PathBuf::from(dir.split(", Redis keys").next().unwrap())
}

async fn postgres_databases(url: &str) -> Option<Vec<String>> {
    let options = sqlx::postgres::PgConnectOptions::from_str(url)
        .expect("postgres url")
        .disable_statement_logging();
    let connect = sqlx::PgConnection::connect_with(&options);
    let mut connection = match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(connection)) => connection,
        Ok(Err(error)) => return absent("postgres", error),
        Err(_) => return absent("postgres", "no answer within 5 s"),
    };
    let names = sqlx::query_scalar("SELECT datname::text FROM pg_database")
        .fetch_all(&mut connection)
        .await
        .expect("list databases");
    Some(names)
}

async fn mysql_databases(url: &str) -> Option<Vec<String>> {
    let options = sqlx::mysql::MySqlConnectOptions::from_str(url)
        .expect("mysql url")
        .disable_statement_logging();
    let connect = sqlx::MySqlConnection::connect_with(&options);
    let mut connection = match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(connection)) => connection,
        Ok(Err(error)) => return absent("mysql", error),
        Err(_) => return absent("mysql", "no answer within 5 s"),
    };
    let names = sqlx::query_scalar("SHOW DATABASES")
        .fetch_all(&mut connection)
        .await
        .expect("list databases");
    Some(names)
}

fn of_run(names: &[String], run: &str) -> Vec<String> {
    let prefix = format!("agentgate_conformance_{run}");
    names
        .iter()
        .filter(|name| name.starts_with(&prefix))
        .cloned()
        .collect()
}

/// A few checks on a temp SQLite path: exit 0, one row per check (the
/// SIGKILL check through `agentgate hold`, the clock-skew check skipped on
/// SQLite), and the scratch dir is gone; the given path is never created.
#[test]
fn sqlite_checks_pass_and_the_scratch_dir_is_removed() {
    let parent = tempfile::tempdir().unwrap();
    let store = parent.path().join("mine.db");
    let run = conformance(&[
        "--store",
        store.to_str().unwrap(),
        "--only",
        "duplicate_storm",
        "--only",
        "sigkilled_holder",
        "--only",
        "skewed_clock",
    ]);
    assert_eq!(run.code, Some(0));
    assert_eq!(result_of(&run.stdout, "duplicate_storm"), Some("ok"));
    assert_eq!(
        result_of(&run.stdout, "sigkilled_holder_is_taken_over_after_ttl"),
        Some("ok")
    );
    assert_eq!(
        result_of(&run.stdout, "skewed_clock_changes_nothing"),
        Some("skipped")
    );
    assert!(
        run.stdout
            .contains("sqlite: 2 passed, 0 failed, 1 skipped of 3 checks"),
        "{}",
        run.stdout
    );
    assert!(run.stderr.contains("[1/3] duplicate_storm … ok ("));
    let dir = sqlite_dir(&run.stderr);
    assert!(
        dir.starts_with(parent.path()),
        "made next to the given path"
    );
    assert!(
        !dir.exists(),
        "the scratch dir {} is removed",
        dir.display()
    );
    assert!(!store.exists(), "the user's own file is never touched");
}

/// `--list` names every check of the registry with its description.
#[test]
fn list_names_every_check() {
    let run = conformance(&["--list"]);
    assert_eq!(run.code, Some(0));
    for check in agentgate_conformance::registry::CHECKS {
        assert!(
            run.stdout
                .lines()
                .any(|l| l.starts_with(check.name) && l.ends_with(check.description)),
            "{} is listed",
            check.name
        );
    }
}

/// Runs that cannot start exit 2 fast with one clear line: an unreachable
/// server, a URL of another kind, a SQLite path in a missing directory, an
/// unreachable Redis, and a filter no check matches.
#[test]
fn runs_that_cannot_start_exit_2_quickly() {
    let cases: [(&[&str], &str); 5] = [
        (
            &["--store", "postgres://postgres@127.0.0.1:1/postgres"],
            "cannot connect to postgres://postgres@127.0.0.1:1/postgres",
        ),
        (
            &["--store", "mongodb://127.0.0.1/db"],
            "unsupported store URL scheme",
        ),
        (
            &["--store", "/no/such/directory/app.db"],
            "no such directory",
        ),
        (
            &["--store", "/tmp/x.db", "--redis", "redis://127.0.0.1:1/0"],
            "cannot connect to redis://127.0.0.1:1/0",
        ),
        (
            &["--store", "/tmp/x.db", "--only", "no_check_is_called_this"],
            "no check name contains",
        ),
    ];
    for (args, says) in cases {
        let run = conformance(args);
        assert_eq!(run.code, Some(2), "{args:?}");
        assert!(
            run.took < CANNOT_START_WITHIN,
            "{args:?} took {:?}",
            run.took
        );
        let line = run.stderr.trim();
        assert_eq!(line.lines().count(), 1, "one line: {line}");
        assert!(
            line.starts_with("agentgate conformance: cannot start: ") && line.contains(says),
            "{args:?}: {line}"
        );
        assert!(
            run.stdout.is_empty(),
            "no table for a run that did not start"
        );
    }
}

/// On PostgreSQL: the checks pass in scratch databases of the run, and none
/// of them is left afterwards.
#[tokio::test]
async fn postgres_scratch_databases_are_dropped() {
    let url = postgres_url();
    let Some(before) = postgres_databases(&url).await else {
        return;
    };
    let run = conformance(&[
        "--store",
        &url,
        "--only",
        "duplicate_storm",
        "--only",
        "takeover_fences",
    ]);
    assert_eq!(run.code, Some(0));
    assert_eq!(result_of(&run.stdout, "duplicate_storm"), Some("ok"));
    assert_eq!(
        result_of(&run.stdout, "takeover_fences_the_old_holder"),
        Some("ok")
    );
    let id = run_id(&run.stderr);
    assert!(of_run(&before, &id).is_empty());
    let after = postgres_databases(&url).await.unwrap();
    assert_eq!(of_run(&after, &id), Vec::<String>::new(), "all dropped");
}

/// On MySQL/MariaDB: the same.
#[tokio::test]
async fn mysql_scratch_databases_are_dropped() {
    let url = mysql_url();
    if mysql_databases(&url).await.is_none() {
        return;
    }
    let run = conformance(&[
        "--store",
        &url,
        "--only",
        "duplicate_storm",
        "--only",
        "tool_storm",
    ]);
    assert_eq!(run.code, Some(0));
    assert_eq!(result_of(&run.stdout, "duplicate_storm"), Some("ok"));
    assert_eq!(result_of(&run.stdout, "tool_storm"), Some("ok"));
    let id = run_id(&run.stderr);
    let after = mysql_databases(&url).await.unwrap();
    assert_eq!(of_run(&after, &id), Vec::<String>::new(), "all dropped");
}

/// With Redis: a Redis-loss check passes under the run's key prefix, and no
/// key of the run is left afterwards.
#[tokio::test]
async fn redis_keys_of_the_run_are_deleted() {
    let redis = redis_url();
    let client = redis::Client::open(redis.as_str()).expect("redis url");
    let connect = client.get_multiplexed_async_connection();
    let mut connection = match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(connection)) => connection,
        Ok(Err(error)) => {
            absent::<()>("redis", error);
            return;
        }
        Err(_) => {
            absent::<()>("redis", "no answer within 5 s");
            return;
        }
    };
    let parent = tempfile::tempdir().unwrap();
    let run = conformance(&[
        "--store",
        parent.path().to_str().unwrap(),
        "--redis",
        &redis,
        "--only",
        "redis_loss_is_fenced",
        "--only",
        "duplicate_storm",
    ]);
    assert_eq!(run.code, Some(0));
    assert_eq!(result_of(&run.stdout, "redis_loss_is_fenced"), Some("ok"));
    assert_eq!(result_of(&run.stdout, "duplicate_storm"), Some("ok"));
    let id = run_id(&run.stderr);
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("agentgate-conformance:{id}:*"))
        .query_async(&mut connection)
        .await
        .expect("list keys");
    assert_eq!(keys, Vec::<String>::new(), "the run's keys are deleted");
}

/// Ctrl-C mid-check: the run stops, says so, exits 130, and drops the
/// scratch database that existed while the check ran.
#[tokio::test]
async fn ctrl_c_drops_the_scratch_database() {
    let url = postgres_url();
    if postgres_databases(&url).await.is_none() {
        return;
    }
    // This check runs four lease TTLs (3.2 s): long enough to interrupt.
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentgate"))
        .args([
            "conformance",
            "--store",
            &url,
            "--only",
            "watchdog_keeps_a_long_turn",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn agentgate conformance");
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut header = String::new();
    stderr.read_line(&mut header).expect("read the header");
    let id = run_id(&header);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let during = of_run(&postgres_databases(&url).await.unwrap(), &id);
    assert_eq!(during.len(), 1, "the check's scratch database exists");
    let sent = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("send SIGINT");
    assert!(sent.success());
    let output = child.wait_with_output().expect("wait");
    let stdout = String::from_utf8(output.stdout).unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).unwrap();
    eprintln!("--- stdout\n{stdout}--- stderr\n{header}{rest}");
    assert_eq!(output.status.code(), Some(130));
    assert!(rest.contains("interrupted"), "{rest}");
    assert!(stdout.contains("(interrupted)"), "{stdout}");
    let after = of_run(&postgres_databases(&url).await.unwrap(), &id);
    assert_eq!(after, Vec::<String>::new(), "dropped after Ctrl-C");
}

/// A user who may not create databases: exit 2, naming the privilege.
#[tokio::test]
async fn missing_create_privilege_is_named() {
    let url = postgres_url();
    if postgres_databases(&url).await.is_none() {
        return;
    }
    let options = sqlx::postgres::PgConnectOptions::from_str(&url).unwrap();
    let mut admin = sqlx::PgConnection::connect_with(&options).await.unwrap();
    // Idempotent: the role may exist from an earlier run. It has a
    // password, so a server that asks for one (md5, scram) lets it in too:
    // the login must succeed for the check to prove anything, and it is
    // asserted, never skipped.
    sqlx::raw_sql(
        "DO $$ BEGIN \
           CREATE ROLE agentgate_conformance_nocreate LOGIN NOCREATEDB; \
         EXCEPTION WHEN duplicate_object THEN NULL; END $$; \
         ALTER ROLE agentgate_conformance_nocreate LOGIN NOCREATEDB PASSWORD 'nocreate-test'",
    )
    .execute(&mut admin)
    .await
    .expect("create a role without CREATEDB");
    let host = url
        .split('@')
        .nth(1)
        .expect("the test URL names a user@host");
    let store = format!("postgres://agentgate_conformance_nocreate:nocreate-test@{host}");
    let run = conformance(&["--store", &store]);
    assert!(
        !run.stderr.contains("cannot connect"),
        "the test role's login was refused, so nothing was proven: {}",
        run.stderr
    );
    assert_eq!(run.code, Some(2), "{}", run.stderr);
    assert!(
        run.stderr.contains("may not create databases"),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("CREATEDB"), "{}", run.stderr);
    assert!(run.took < CANNOT_START_WITHIN);
}

/// A check that fails (here: runs past `--check-timeout`) is a FAILED row
/// with its message, the run goes on to the next check, and exits 1.
#[test]
fn a_failed_check_is_a_row_and_exit_1() {
    let parent = tempfile::tempdir().unwrap();
    let run = conformance(&[
        "--store",
        parent.path().to_str().unwrap(),
        "--check-timeout",
        "1",
        // Runs four lease TTLs (3.2 s); the other finishes in well under 1 s.
        "--only",
        "watchdog_keeps_a_long_turn",
        "--only",
        "session_storm",
    ]);
    assert_eq!(run.code, Some(1));
    assert_eq!(
        result_of(&run.stdout, "watchdog_keeps_a_long_turn"),
        Some("FAILED")
    );
    assert!(
        run.stdout.contains("    did not finish within 1 s"),
        "{}",
        run.stdout
    );
    assert_eq!(result_of(&run.stdout, "session_storm"), Some("ok"));
    assert!(run
        .stdout
        .contains("sqlite: 1 passed, 1 failed, 0 skipped of 2 checks"));
    assert!(
        !sqlite_dir(&run.stderr).exists(),
        "removed after a failure too"
    );
}
