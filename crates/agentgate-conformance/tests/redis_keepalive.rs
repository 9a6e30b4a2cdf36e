//! Every connection the Redis lease layer opens probes a silent peer with
//! TCP keepalive (`REDIS_KEEPALIVE_IDLE`, `_INTERVAL`, `_PROBES`): the
//! event subscriber's connection is idle whenever nothing is appended, and
//! no command timeout watches it, so without probes a Redis host that
//! vanished leaves it open for hours and cross-node wake-ups stop.
//!
//! Linux shows it in `/proc/net/tcp`: an established socket with
//! `SO_KEEPALIVE` and nothing in flight has its keepalive timer running
//! (`tr` = 2); one without has none (`tr` = 0). The test finds this
//! process's own sockets (by inode, from `/proc/self/fd`) that lead to the
//! Redis port and checks each. Skipped with a printed reason when Redis is
//! absent, unless `AGENTGATE_REQUIRE_SERVICES=1`.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;

use agentgate_conformance::targets;

/// This process's socket inodes.
fn own_socket_inodes() -> HashSet<String> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .filter_map(|link| {
            let link = link.to_string_lossy().into_owned();
            Some(link.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect()
}

/// The timer kind (`tr`) of each of this process's established TCP
/// sockets whose remote port is `port`.
fn timers_to_port(port: u16) -> Vec<u8> {
    let own = own_socket_inodes();
    let mut timers = Vec::new();
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let remote_port = fields[2].rsplit(':').next().unwrap();
            let established = fields[3] == "01";
            let (timer, inode) = (fields[5], fields[9]);
            if established
                && u16::from_str_radix(remote_port, 16).unwrap() == port
                && own.contains(inode)
            {
                timers.push(timer.split(':').next().unwrap().parse().unwrap());
            }
        }
    }
    timers
}

#[tokio::test]
async fn every_redis_connection_has_tcp_keepalive() {
    let Some(url) = targets::redis_url().await else {
        return;
    };
    let port: u16 = url
        .trim_start_matches("redis://")
        .split(['/', '?'])
        .next()
        .and_then(|address| address.rsplit(':').next())
        .and_then(|port| port.parse().ok())
        .unwrap_or(6379);
    let before = timers_to_port(port).len();
    let layer = agentgate_store_redis::RedisLeases::open(&url)
        .await
        .expect("open the layer");
    // Let the connection settle: nothing in flight, only the idle timer.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let timers = timers_to_port(port);
    assert!(
        timers.len() > before,
        "the layer's connection to port {port} is found ({timers:?})"
    );
    assert!(
        timers.iter().all(|&timer| timer == 2),
        "every connection to Redis runs a keepalive timer (tr=2): {timers:?}"
    );
    println!(
        "{} connection(s) to Redis, each with keepalive",
        timers.len()
    );
    drop(layer);
}
