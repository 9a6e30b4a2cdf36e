//! A real child process holds a lease and is killed with SIGKILL: the lease
//! is not acquirable before its TTL and is acquirable after, by a takeover
//! that sees the child's tool call as unknown.

use std::process::Stdio;
use std::time::Duration;

use agentgate::{ErrorKind, PreviousOutcome, ToolStep};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};

use super::{report, short_ttl, start_within, SHORT_TTL};
use crate::holder::Holder;
use crate::Target;

/// Spawns the holder on the target, waits until it holds the lease and has
/// claimed a tool, kills it with SIGKILL, and takes over.
///
/// # Panics
/// When any step of the scenario does not hold.
pub async fn sigkilled_holder_is_taken_over_after_ttl(target: &Target, holder: &Holder) {
    let gate = target.gate(short_ttl()).await;
    let mut child = holder
        .command()
        .arg(&target.store_url)
        .arg(target.redis_url.as_deref().unwrap_or("-"))
        .args(["kill-user", "kill-session", "r1"])
        .arg(SHORT_TTL.as_millis().to_string())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the holder");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the holder reports in time")
        .expect("read the holder")
        .expect("the holder printed a line");
    let fence: i64 = ready
        .strip_prefix("HOLDING ")
        .and_then(|rest| rest.split_whitespace().nth(1))
        .and_then(|f| f.parse().ok())
        .unwrap_or_else(|| panic!("unexpected holder line {ready:?}"));

    // While the child lives, its watchdog keeps the lease past several TTLs.
    tokio::time::sleep(SHORT_TTL * 2).await;
    let busy = gate
        .begin("kill-user", "kill-session", "r2", &json!(2))
        .await
        .expect_err("held by the child");
    assert_eq!(busy.kind(), ErrorKind::SessionBusy);

    child.start_kill().expect("SIGKILL the holder");
    let killed_at = tokio::time::Instant::now();
    let status = child.wait().await.expect("reap the holder");
    assert!(!status.success(), "the holder was killed, not finished");
    // Right after the kill the lease is still live: not acquirable before its TTL.
    let early = gate
        .begin("kill-user", "kill-session", "r1", &json!({"text": "r1"}))
        .await
        .expect_err("still leased");
    assert_eq!(early.kind(), ErrorKind::RequestInFlight, "{early}");
    let taker = start_within(&gate, "kill-user", "kill-session", "r1", SHORT_TTL * 4).await;
    let waited = killed_at.elapsed();
    assert!(
        waited <= SHORT_TTL + Duration::from_secs(2),
        "taken over {waited:?} after the kill"
    );
    assert!(taker.is_takeover());
    assert_eq!(taker.attempt(), 2);
    assert!(taker.fence().0 > fence);
    match taker
        .tool("book", &json!({"amount": 18}))
        .await
        .expect("claim")
    {
        ToolStep::Execute(execution) => {
            assert_eq!(execution.previous_outcome(), Some(PreviousOutcome::Unknown));
            execution
                .complete(&json!({"entry": 1}))
                .await
                .expect("complete");
        }
        ToolStep::Cached(_) => panic!("the killed holder never completed the call"),
    }
    taker.succeed(&json!("done")).await.expect("succeed");
    let counts = [
        ("killed".to_owned(), 1),
        ("refused_before_ttl".to_owned(), 1),
        ("takeover_after_ttl".to_owned(), 1),
        (
            "takeover_ms".to_owned(),
            usize::try_from(waited.as_millis()).unwrap_or(usize::MAX),
        ),
    ];
    report(
        target,
        "sigkilled_holder_is_taken_over_after_ttl",
        &counts.into_iter().collect(),
    );
}

/// SIGKILLs a process group; whether a process received it.
async fn kill_group(group: u32) -> bool {
    tokio::process::Command::new("kill")
        .args(["-KILL", "--", &format!("-{group}")])
        .stderr(Stdio::null())
        .status()
        .await
        .is_ok_and(|status| status.success())
}

/// How far the skewed holder's clock is set off: a day, far beyond any TTL.
const CLOCK_SKEW: &str = "+1d";

/// Finds `faketime`, or reports it absent (skip, or fail when required).
fn faketime() -> Option<std::path::PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("faketime"))
            .find(|candidate| candidate.is_file())
    });
    found.or_else(|| crate::targets::absent("faketime", "not on PATH (apt-get install faketime)"))
}

/// A holder whose wall clock is a day ahead changes no outcome on a store
/// with its own clock: its lease lives exactly as long as anyone's, it is
/// taken over only after the TTL, and a skewed node cannot take over a live
/// lease early.
///
/// # Panics
/// When any step of the scenario does not hold.
pub async fn skewed_clock_changes_nothing(target: &Target, holder: &Holder) {
    let Some(faketime) = faketime() else { return };
    let gate = target.gate(short_ttl()).await;
    let redis = target.redis_url.as_deref().unwrap_or("-");
    let ttl_ms = SHORT_TTL.as_millis().to_string();
    let spawn = |session: &str| {
        holder
            .command_under(&faketime, &["-f", CLOCK_SKEW])
            .args([
                &target.store_url,
                redis,
                "skew-user",
                session,
                "r1",
                &ttl_ms,
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // faketime forks the holder; a process group lets one SIGKILL
            // reach both, and kill_on_drop covers a failing assertion.
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the skewed holder")
    };

    // 1. The skewed node holds: refused for several TTLs, taken over after one.
    let mut child = spawn("skew-session");
    let stdout = child.stdout.take().expect("piped stdout");
    let line = tokio::time::timeout(
        Duration::from_secs(30),
        BufReader::new(stdout).lines().next_line(),
    )
    .await
    .expect("the skewed holder reports in time")
    .expect("read")
    .unwrap_or_else(|| panic!("the skewed holder exited: {:?}", child.try_wait()));
    assert!(line.starts_with("HOLDING "), "{line}");
    tokio::time::sleep(SHORT_TTL * 2).await;
    let busy = gate
        .begin("skew-user", "skew-session", "r2", &json!(2))
        .await
        .expect_err("held");
    assert_eq!(
        busy.kind(),
        ErrorKind::SessionBusy,
        "a skewed holder's lease lives"
    );
    let group = child.id().expect("the skewed holder is running");
    assert!(
        kill_group(group).await,
        "SIGKILL the skewed holder's process group"
    );
    child.wait().await.expect("reap");
    let early = gate
        .begin("skew-user", "skew-session", "r1", &json!({"text": "r1"}))
        .await
        .expect_err("live");
    assert_eq!(early.kind(), ErrorKind::RequestInFlight);
    let taker = start_within(&gate, "skew-user", "skew-session", "r1", SHORT_TTL * 4).await;
    assert!(taker.is_takeover());

    // 2. While this node holds, the skewed node cannot take over early: its
    // begin is refused as in flight under this node's turn, and it says so.
    let mut intruder = spawn("skew-session");
    let group = intruder.id().expect("the skewed node is running");
    let mut stderr = intruder.stderr.take().expect("piped stderr");
    let status = tokio::time::timeout(Duration::from_secs(30), intruder.wait())
        .await
        .expect("the skewed node gives up in time")
        .expect("reap");
    // The wrapper exited with its child; make sure no stray process is left.
    kill_group(group).await;
    let mut said = String::new();
    stderr
        .read_to_string(&mut said)
        .await
        .expect("read the skewed node's stderr");
    assert!(
        !status.success(),
        "the skewed node must not take a live lease"
    );
    // `agentgate-holder`'s `main` returning the engine's error prints its
    // Debug form; `agentgate hold` prints its Display form.
    let in_flight =
        said.contains("RequestInFlight") || said.contains("request is already in flight");
    assert!(
        in_flight && said.contains(taker.id().as_str()),
        "the skewed node was refused as in flight under {}, it said: {said}",
        taker.id()
    );
    assert!(!taker.is_cancelled());
    taker
        .succeed(&json!("ok"))
        .await
        .expect("the holder keeps its lease");
    let counts = [
        ("skewed_holder_kept_lease".to_owned(), 1),
        ("takeover_after_ttl".to_owned(), 1),
        ("skewed_early_takeover_refused".to_owned(), 1),
    ];
    report(
        target,
        "skewed_clock_changes_nothing",
        &counts.into_iter().collect(),
    );
}
