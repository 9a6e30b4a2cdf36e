//! The Python and TypeScript clients' own suites (`clients/*/test.sh`), run
//! once on the source tree, once on the packages a user installs (the
//! wheel built from the sdist in a fresh venv, the `npm pack` tarball in a
//! fresh npm project: `clients/check-packages.sh`) and their interrupt,
//! queue, drain, recovery and event tests once more on PostgreSQL
//! (`clients/postgres-subsets.sh`), the generated-client check
//! (`clients/generated/check.sh`), the Python
//! framework examples (`examples/python/test.sh`) and the Java example
//! (`examples/java/test.sh`), run against this build's binary, so the
//! README's test command covers them.
//!
//! Each needs what its setup installs from the package registries (a venv,
//! `npm ci`) or a toolchain (a JDK 17+ for Java). Where that is absent the suite is skipped with the
//! reason printed, unless `AGENTGATE_REQUIRE_SERVICES=1` (CI, whose
//! `.ci/run` runs the setups first) makes absence a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The environment variable that turns a missing toolchain into a failure.
const REQUIRE_SERVICES_ENV: &str = "AGENTGATE_REQUIRE_SERVICES";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root exists")
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target"))
}

/// Skips (printing why) or, when services are required, fails.
fn absent(suite: &str, reason: &str) {
    let required = std::env::var(REQUIRE_SERVICES_ENV).is_ok_and(|v| v == "1");
    assert!(
        !required,
        "the {suite} suite is required ({REQUIRE_SERVICES_ENV}=1) but {reason}"
    );
    eprintln!("skipped: the {suite} suite: {reason}; run its setup (see .ci/run) to include it");
}

/// Runs `script` (relative to the repository) against this build's binary
/// and asserts it passed.
fn run_suite(script: &str) {
    run_suite_with(script, &[]);
}

/// [`run_suite`] with arguments for the script.
fn run_suite_with(script: &str, args: &[&str]) {
    let script = repo().join(script);
    let status = Command::new("bash")
        .arg(&script)
        .args(args)
        .env("AGENTGATE_BIN", env!("CARGO_BIN_EXE_agentgate"))
        .status()
        .unwrap_or_else(|e| panic!("could not run {}: {e}", script.display()));
    assert!(status.success(), "{} failed: {status}", script.display());
}

/// The Python client (`clients/python`): pytest against the real server,
/// in the venv `clients/python/setup.sh` makes.
#[test]
fn python_client_suite_passes_against_this_binary() {
    let venv = std::env::var_os("AGENTGATE_PY_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("clients-python-venv"));
    if !venv.join("bin/python").exists() {
        return absent("python", &format!("no venv at {}", venv.display()));
    }
    run_suite("clients/python/test.sh");
}

/// Held by every test that builds or imports `clients/typescript/dist`:
/// the client's `test.sh` rebuilds it, and the Vercel AI SDK example
/// imports it through a link, so they must not overlap.
static TYPESCRIPT_DIST: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn typescript_dist() -> std::sync::MutexGuard<'static, ()> {
    TYPESCRIPT_DIST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The TypeScript client (`clients/typescript`): `node --test` against the
/// real server, with the packages `npm ci` installed.
#[test]
fn typescript_client_suite_passes_against_this_binary() {
    let _dist = typescript_dist();
    let modules = repo().join("clients/typescript/node_modules");
    if !modules.exists() {
        return absent("typescript", &format!("no {}", modules.display()));
    }
    let node = Command::new("node").arg("--version").output();
    if !node.is_ok_and(|out| out.status.success()) {
        return absent("typescript", "node is not on PATH");
    }
    run_suite("clients/typescript/test.sh");
}

/// The Python client as a user installs it: `clients/check-packages.sh
/// python` builds the sdist and, from it, the wheel (`python -m build`),
/// installs the wheel into the fresh venv `clients/check-packages.sh setup`
/// made, and runs the suite there with the source tree off `sys.path`
/// (`tests/test_installed.py` asserts `agentgate` is the venv's copy).
#[test]
fn python_client_suite_passes_against_the_installed_wheel() {
    let build = target_dir().join("clients-python-build-venv");
    let venv = target_dir().join("clients-python-installed-venv");
    if !build.join("bin/python").exists() || !venv.join("bin/python").exists() {
        return absent(
            "installed python package",
            &format!("no {} or {}", build.display(), venv.display()),
        );
    }
    run_suite_with("clients/check-packages.sh", &["python"]);
}

/// The TypeScript client as a user installs it: `clients/check-packages.sh
/// typescript` packs it from a copy without `dist/` (its prepare script
/// builds that), installs the tarball into a fresh npm project under
/// `target/`, and runs the suite against that install
/// (`test/installed.test.mjs` asserts every import of the client resolves
/// there).
#[test]
fn typescript_client_suite_passes_against_the_installed_tarball() {
    let modules = repo().join("clients/typescript/node_modules");
    if !modules.exists() {
        return absent(
            "installed typescript package",
            &format!("no {}", modules.display()),
        );
    }
    let node = Command::new("node").arg("--version").output();
    if !node.is_ok_and(|out| out.status.success()) {
        return absent("installed typescript package", "node is not on PATH");
    }
    run_suite_with("clients/check-packages.sh", &["typescript"]);
}

/// The OpenAPI document generates working clients: `openapi-python-client`
/// runs a full turn, `openapi-typescript` types check, and no breaking change
/// since the committed snapshot (`clients/generated/check.sh`).
#[test]
fn generated_clients_run_a_turn_and_the_document_has_no_breaking_change() {
    let venv = target_dir().join("clients-gen-venv");
    let modules = repo().join("clients/generated/node_modules");
    if !venv.join("bin/python").exists() || !modules.exists() {
        return absent(
            "generated",
            &format!("no {} or {}", venv.display(), modules.display()),
        );
    }
    run_suite("clients/generated/check.sh");
}

/// The LangGraph and OpenAI Agents SDK examples, double-texted and killed
/// mid-tool, book once (`examples/python/test.sh`).
#[test]
fn python_framework_examples_book_once() {
    let venv = target_dir().join("examples-python-venv");
    if !venv.join("bin/python").exists() {
        return absent("python examples", &format!("no venv at {}", venv.display()));
    }
    run_suite("examples/python/test.sh");
}

/// The Java example (`examples/java/AgentgateTurn.java`, JDK only), double
/// texted, killed right after booking, paused past its lease, books once
/// (`examples/java/test.sh`).
#[test]
fn java_example_books_once() {
    let java = Command::new("java").arg("-version").output();
    if !java.is_ok_and(|out| out.status.success()) {
        return absent("java example", "java is not on PATH");
    }
    run_suite("examples/java/test.sh");
}

/// Whether the PostgreSQL server the client subsets use answers (`psql`).
fn postgres_answers() -> Result<(), String> {
    let server = std::env::var("AGENTGATE_CLIENT_TEST_PG")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned());
    let probe = Command::new("psql")
        .arg(format!("{server}/postgres"))
        .args(["-tAc", "SELECT 1"])
        .output()
        .map_err(|e| format!("psql cannot run: {e}"))?;
    if probe.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{server} does not answer: {}",
            String::from_utf8_lossy(&probe.stderr).trim()
        ))
    }
}

/// The Python client's interrupt, queue, drain, recovery, crash and
/// event-following tests on PostgreSQL (`clients/postgres-subsets.sh
/// python`): each server gets a database of its own.
#[test]
fn python_client_subset_passes_on_postgres() {
    let venv = std::env::var_os("AGENTGATE_PY_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("clients-python-venv"));
    if !venv.join("bin/python").exists() {
        return absent(
            "python on postgres",
            &format!("no venv at {}", venv.display()),
        );
    }
    if let Err(reason) = postgres_answers() {
        return absent("python on postgres", &reason);
    }
    run_suite_with("clients/postgres-subsets.sh", &["python"]);
}

/// The TypeScript client's interrupt, queue, drain, recovery, crash and
/// event-following tests on PostgreSQL (`clients/postgres-subsets.sh
/// typescript`).
#[test]
fn typescript_client_subset_passes_on_postgres() {
    let _dist = typescript_dist();
    let modules = repo().join("clients/typescript/node_modules");
    if !modules.exists() {
        return absent(
            "typescript on postgres",
            &format!("no {}", modules.display()),
        );
    }
    if let Err(reason) = postgres_answers() {
        return absent("typescript on postgres", &reason);
    }
    run_suite_with("clients/postgres-subsets.sh", &["typescript"]);
}

/// The Vercel AI SDK example (`examples/typescript/vercel-ai`): its chat
/// route streams a mock model's reply through the turn's event log; a
/// reader that drops the stream and resumes on another app node with
/// `Last-Event-ID` gets the rest exactly once, and a double-sent message
/// calls the model and books once.
#[test]
fn vercel_ai_example_resumes_a_reply_and_books_once() {
    let _dist = typescript_dist();
    let modules = repo().join("examples/typescript/vercel-ai/node_modules");
    if !modules.exists() {
        return absent("vercel ai example", &format!("no {}", modules.display()));
    }
    run_suite("examples/typescript/vercel-ai/test.sh");
}
