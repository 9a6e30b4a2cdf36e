//! Many app nodes, one database: two `agentgate serve` processes on one
//! PostgreSQL database (and on one MariaDB database) take the duplicate,
//! session and tool storms split across both, and still answer exactly one
//! of each; SIGKILL one mid-turn and the other takes over after the TTL.
//!
//! Skipped with a printed reason when the database server is absent, unless
//! `AGENTGATE_REQUIRE_SERVICES=1`.

#[allow(dead_code)] // the support module serves several test binaries
mod support;

use std::time::{Duration, Instant};

use agentgate_conformance::Target;
use serde_json::json;
use support::{lease, storm, tally, Client, Server};

/// Clients per storm, split evenly across the two nodes.
const STORM: usize = 60;

/// A short lease so the takeover after the kill is quick.
const TTL_MS: &str = "1500";

fn nodes(target: &Target, dir: &std::path::Path) -> (Server, Server) {
    let args = ["--lease-ttl-ms", TTL_MS, "--max-turns-per-user", "100"];
    let a = Server::start_on_store(&target.store_url, dir.join("node-a.log"), &args);
    let b = Server::start_on_store(&target.store_url, dir.join("node-b.log"), &args);
    (a, b)
}

fn pick(clients: &[Client; 2], index: usize) -> Client {
    clients[index % 2].clone()
}

async fn complete(client: &Client, turn: &str, token: &str, response: serde_json::Value) {
    client
        .post(
            &format!("/v1/turns/{turn}/complete"),
            Some(token),
            &json!({"response": response}),
        )
        .await
        .expect(200, "");
}

async fn duplicate_storm(clients: &[Client; 2]) {
    let payload = json!({"text": "taxi 18"});
    let replies = storm(STORM, |i| {
        let (client, payload) = (pick(clients, i), payload.clone());
        async move { client.begin("mn-user", "mn-dup", "r1", &payload).await }
    })
    .await;
    let counts = tally(&replies);
    assert_eq!(counts.get(&(201, String::new())), Some(&1), "{counts:?}");
    assert_eq!(
        counts.get(&(409, "request_in_flight".to_owned())),
        Some(&(STORM - 1)),
        "{counts:?}"
    );
    let winner = replies.iter().find(|r| r.status == 201).expect("one grant");
    let (turn, token) = lease(winner);
    // Ended through the other node than most of the storm hit: nodes share nothing but the database.
    complete(&clients[1], &turn, &token, json!({"text": "booked"})).await;
    let replays = storm(STORM, |i| {
        let (client, payload) = (pick(clients, i), payload.clone());
        async move { client.begin("mn-user", "mn-dup", "r1", &payload).await }
    })
    .await;
    assert!(replays
        .iter()
        .all(|r| r.status == 200 && r.body["replay"] == json!(true)));
    println!(
        "multinode duplicate storm: {counts:?}, replays={}",
        replays.len()
    );
}

async fn session_storm(clients: &[Client; 2]) {
    let replies = storm(STORM, |i| {
        let client = pick(clients, i);
        async move {
            client
                .begin("mn-user", "mn-session", &format!("r{i}"), &json!(i))
                .await
        }
    })
    .await;
    let counts = tally(&replies);
    assert_eq!(counts.get(&(201, String::new())), Some(&1), "{counts:?}");
    assert_eq!(
        counts.get(&(409, "session_busy".to_owned())),
        Some(&(STORM - 1)),
        "{counts:?}"
    );
    let (turn, token) = lease(replies.iter().find(|r| r.status == 201).expect("one grant"));
    complete(&clients[0], &turn, &token, json!("done")).await;
    println!("multinode session storm: {counts:?}");
}

async fn tool_storm(clients: &[Client; 2]) {
    let begun = clients[0]
        .begin("mn-user", "mn-tools", "r1", &json!(1))
        .await;
    let (turn, token) = lease(&begun);
    let path = format!("/v1/turns/{turn}/tools");
    let replies = storm(STORM, |i| {
        let (client, path, token) = (pick(clients, i), path.clone(), token.clone());
        async move {
            let body =
                json!({"tool": "create_transaction", "args": {"amount": 35, "type": "expense"}});
            client.post(&path, Some(&token), &body).await
        }
    })
    .await;
    let counts = tally(&replies);
    assert_eq!(counts.get(&(201, String::new())), Some(&1), "{counts:?}");
    assert_eq!(
        counts.get(&(409, "tool_in_flight".to_owned())),
        Some(&(STORM - 1)),
        "{counts:?}"
    );
    let winner = replies
        .iter()
        .find(|r| r.status == 201)
        .expect("one execute");
    let execution = winner.body["execution"]["execution_id"]
        .as_str()
        .expect("id")
        .to_owned();
    clients[1]
        .post(
            &format!("{path}/{execution}/complete"),
            Some(&token),
            &json!({"result": {"entry": 1}}),
        )
        .await
        .expect(200, "");
    let cached = clients[0]
        .post(
            &path,
            Some(&token),
            &json!({"tool": "create_transaction", "args": {"type": "expense", "amount": 35.0}}),
        )
        .await
        .expect(200, "");
    assert_eq!(cached.body["execute"], json!(false));
    assert_eq!(cached.body["execution"]["result"], json!({"entry": 1}));
    complete(&clients[1], &turn, &token, json!("ok")).await;
    println!("multinode tool storm: {counts:?}");
}

async fn kill_one_node(a: &mut Server, b: &Server) {
    let survivor = b.client();
    let doomed = a.client();
    let begun = doomed
        .begin("mn-user", "mn-kill", "r1", &json!({"text": "r1"}))
        .await;
    let (turn, token) = lease(&begun);
    let fence = begun.body["turn"]["fence"].as_i64().expect("fence");
    doomed
        .post(
            &format!("/v1/turns/{turn}/tools"),
            Some(&token),
            &json!({"tool": "book", "args": {"amount": 18}}),
        )
        .await
        .expect(201, "");
    a.kill();
    let killed = Instant::now();
    survivor
        .begin("mn-user", "mn-kill", "r1", &json!({"text": "r1"}))
        .await
        .expect(409, "request_in_flight");
    let taken = loop {
        let reply = survivor
            .begin("mn-user", "mn-kill", "r1", &json!({"text": "r1"}))
            .await;
        if reply.status == 201 {
            break reply;
        }
        assert_eq!(reply.code(), "request_in_flight", "{}", reply.text);
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "no takeover after the TTL"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(taken.body["turn"]["takeover"], json!(true));
    assert!(taken.body["turn"]["fence"].as_i64().expect("fence") > fence);
    let (turn, new_token) = lease(&taken);
    let claim = survivor
        .post(
            &format!("/v1/turns/{turn}/tools"),
            Some(&new_token),
            &json!({"tool": "book", "args": {"amount": 18}}),
        )
        .await
        .expect(201, "");
    assert_eq!(
        claim.body["execution"]["previous_outcome"],
        json!("unknown")
    );
    survivor
        .post(
            &format!("/v1/turns/{turn}/heartbeat"),
            Some(&token),
            &json!({}),
        )
        .await
        .expect(409, "lease_lost");
    println!(
        "multinode kill: taken over {} ms after SIGKILL",
        killed.elapsed().as_millis()
    );
}

async fn scenario(target: Target) {
    let dir = support::scratch();
    let (mut a, b) = nodes(&target, dir.path());
    let clients = [a.client(), b.client()];
    duplicate_storm(&clients).await;
    session_storm(&clients).await;
    tool_storm(&clients).await;
    kill_one_node(&mut a, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_nodes_on_one_postgres_database() {
    let Some(target) = agentgate_conformance::targets::postgres().await else {
        return;
    };
    scenario(target).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_nodes_on_one_mariadb_database() {
    let Some(target) = agentgate_conformance::targets::mysql().await else {
        return;
    };
    scenario(target).await;
}
