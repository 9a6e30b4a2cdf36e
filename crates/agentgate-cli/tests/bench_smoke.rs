//! Smoke tests of `agentgate bench` on SQLite: the real binary, small
//! numbers, and no timing assertions (timings on a shared machine are
//! noise). What must hold whatever the machine: the JSON parses, it has
//! every field scripts compare, exactly one of the storm's duplicate begins
//! started the turn, and round trips were counted.

use std::process::Command;

use serde_json::Value;

fn bench(args: &[&str]) -> Value {
    let output = Command::new(env!("CARGO_BIN_EXE_agentgate"))
        .arg("bench")
        .args([
            "--duration",
            "1",
            "--json",
            "--sessions",
            "500",
            "--count-turns",
            "20",
        ])
        .args(args)
        .output()
        .expect("run agentgate bench");
    assert!(
        output.status.success(),
        "agentgate bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).expect("utf-8 output");
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

fn assert_common(report: &Value, via: &str) {
    for field in [
        "store",
        "via",
        "concurrency",
        "turns_per_s",
        "raw_turns_per_s",
        "ratio",
        "round_trips_per_turn",
        "storm_ms",
        "storm_started",
        "peak_rss_mib",
    ] {
        assert!(report.get(field).is_some(), "missing {field}: {report}");
    }
    assert_eq!(report["store"], "sqlite");
    assert_eq!(report["via"], via);
    assert_eq!(report["storm_started"], 1, "{}", report["storm"]);
    assert_eq!(
        report["storm"]["outcomes"]["request_in_flight"].as_u64(),
        report["storm"]["requests"].as_u64().map(|n| n - 1),
        "every other duplicate begin is told request_in_flight: {}",
        report["storm"]
    );
    assert!(report["turns_per_s"].as_f64().is_some_and(|t| t > 0.0));
    assert!(report["raw_turns_per_s"].as_f64().is_some_and(|t| t > 0.0));
    // Four statements per raw turn, one call each (autocommit).
    assert_eq!(report["raw_round_trips_per_turn"].as_f64(), Some(4.0));
    // The counting pass begins every turn on a new session of a new user:
    // each step is its common case, one autocommit statement (begin and
    // ending through their triggers), so the engine matches the raw count.
    assert_eq!(report["round_trips_per_turn"].as_f64(), Some(4.0));
}

#[test]
fn bench_on_sqlite_through_the_library() {
    let report = bench(&["--scale-sessions", "2000"]);
    assert_common(&report, "library");
    assert!(report["peak_rss_mib"].is_null(), "memory is an HTTP figure");
    assert_eq!(report["storm"]["requests"], 1000, "the default storm");
    assert_eq!(report["scaling"]["large_sessions"], 2000);
}

#[test]
fn bench_on_sqlite_over_http() {
    let report = bench(&[
        "--via",
        "http",
        "--scale-sessions",
        "0",
        "--storm",
        "200",
        "--live-turns",
        "300",
    ]);
    assert_common(&report, "http");
    assert!(report["http_to_library"].as_f64().is_some());
    assert!(report["scaling"].is_null());
    assert_eq!(report["memory"]["live_turns"], 300);
    assert!(report["peak_rss_mib"].as_f64().is_some_and(|mib| mib > 0.0));
}
