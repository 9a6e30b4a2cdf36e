//! A client of the reference app's endpoints (`/app/...`), as the chat page
//! uses them: send a message or a confirmation, get either the refusal (a
//! JSON error, before any stream) or the turn's server-sent events.
//!
//! Transport errors are returned, not panicked on: the chaos run kills the
//! server under its clients.
#![allow(dead_code)] // shared by several test binaries, each using a part

use std::time::Duration;

use serde_json::{json, Value};

/// Longest a request (a whole turn's stream included) may take: far above a
/// turn of the offline model with the think times the tests use.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// One server-sent event: its name and its JSON data.
pub type Event = (String, Value);

/// What a send or confirmation got.
#[derive(Debug)]
pub enum Sent {
    /// Refused before any stream: status, `error.code`, the whole body and
    /// the `Retry-After` header.
    Refused {
        /// The HTTP status.
        status: u16,
        /// `error.code`.
        code: String,
        /// The JSON body.
        body: Value,
        /// `Retry-After` in seconds.
        retry_after: Option<u64>,
    },
    /// Accepted: every event of the stream, in order.
    Streamed(Vec<Event>),
}

impl Sent {
    /// The events, or a panic naming the refusal.
    #[track_caller]
    pub fn events(self) -> Vec<Event> {
        match self {
            Sent::Streamed(events) => events,
            Sent::Refused { status, body, .. } => panic!("refused with {status}: {body}"),
        }
    }

    /// The refusal's `(status, code)`, or a panic naming the events.
    #[track_caller]
    pub fn refusal(&self) -> (u16, &str) {
        match self {
            Sent::Refused { status, code, .. } => (*status, code.as_str()),
            Sent::Streamed(events) => panic!("expected a refusal, got {events:?}"),
        }
    }
}

/// The last event of `name`, if any.
pub fn last<'a>(events: &'a [Event], name: &str) -> Option<&'a Value> {
    events.iter().rev().find(|(n, _)| n == name).map(|(_, v)| v)
}

/// An open event stream, read event by event.
pub struct EventStream {
    response: reqwest::Response,
    buffer: String,
}

impl EventStream {
    /// The next event; `None` when the stream ended.
    pub async fn next(&mut self) -> Result<Option<Event>, reqwest::Error> {
        loop {
            if let Some(cut) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..cut + 2).collect();
                if let Some(event) = parse_block(&block) {
                    return Ok(Some(event));
                }
                continue;
            }
            match self.response.chunk().await? {
                Some(bytes) => self.buffer.push_str(&String::from_utf8_lossy(&bytes)),
                None => return Ok(None),
            }
        }
    }

    /// Every remaining event, until the stream ends.
    pub async fn rest(mut self) -> Result<Vec<Event>, reqwest::Error> {
        let mut events = Vec::new();
        while let Some(event) = self.next().await? {
            events.push(event);
        }
        Ok(events)
    }
}

fn parse_block(block: &str) -> Option<Event> {
    let mut name = "message".to_owned();
    let mut data = String::new();
    for line in block.lines() {
        if let Some(value) = line.strip_prefix("event:") {
            name = value.trim().to_owned();
        } else if let Some(value) = line.strip_prefix("data:") {
            data.push_str(value.strip_prefix(' ').unwrap_or(value));
        }
    }
    if data.is_empty() {
        return None; // a keep-alive comment
    }
    let value = serde_json::from_str(&data).unwrap_or(Value::String(data));
    Some((name, value))
}

/// An opened send: refused, or a stream to read.
pub enum Opened {
    /// As [`Sent::Refused`].
    Refused(Sent),
    /// Accepted; read it.
    Stream(EventStream),
}

/// A client of one server's app endpoints.
#[derive(Clone)]
pub struct AppClient {
    http: reqwest::Client,
    /// `http://127.0.0.1:PORT`
    pub base: String,
}

impl AppClient {
    /// A client for `base`.
    pub fn new(base: &str) -> Self {
        Self {
            http: reqwest::Client::builder()
                .timeout(REQUEST_TIMEOUT)
                .build()
                .expect("an HTTP client"),
            base: base.to_owned(),
        }
    }

    /// POSTs `body` and returns the refusal or the open stream.
    pub async fn open(&self, path: &str, body: &Value) -> Result<Opened, reqwest::Error> {
        let response = self
            .http
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .await?;
        let status = response.status().as_u16();
        let is_stream = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if status == 200 && is_stream {
            return Ok(Opened::Stream(EventStream {
                response,
                buffer: String::new(),
            }));
        }
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let text = response.text().await?;
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok(Opened::Refused(Sent::Refused {
            status,
            code: body["error"]["code"].as_str().unwrap_or("").to_owned(),
            body,
            retry_after,
        }))
    }

    async fn whole(&self, path: &str, body: &Value) -> Result<Sent, reqwest::Error> {
        match self.open(path, body).await? {
            Opened::Refused(sent) => Ok(sent),
            Opened::Stream(stream) => Ok(Sent::Streamed(stream.rest().await?)),
        }
    }

    /// The body of a chat message.
    pub fn message(user: &str, session: &str, request: &str, text: &str) -> Value {
        json!({"user_id": user, "session_id": session, "client_request_id": request, "text": text})
    }

    /// Sends a chat message and reads its whole stream.
    pub async fn send(
        &self,
        user: &str,
        session: &str,
        request: &str,
        text: &str,
    ) -> Result<Sent, reqwest::Error> {
        self.whole(
            "/app/messages",
            &Self::message(user, session, request, text),
        )
        .await
    }

    /// Answers a pending confirmation and reads the whole stream.
    pub async fn confirm(
        &self,
        user: &str,
        session: &str,
        request: &str,
        turn_id: &str,
        decision: &str,
    ) -> Result<Sent, reqwest::Error> {
        let body = json!({
            "user_id": user, "session_id": session, "client_request_id": request,
            "turn_id": turn_id, "decision": decision,
        });
        self.whole("/app/confirmations", &body).await
    }

    /// GETs a JSON endpoint: `(status, body)`.
    pub async fn get(&self, path: &str) -> Result<(u16, Value), reqwest::Error> {
        let response = self.http.get(format!("{}{path}", self.base)).send().await?;
        let status = response.status().as_u16();
        let text = response.text().await?;
        Ok((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
    }

    /// A user's ledger entries.
    pub async fn entries(&self, user: &str) -> Result<Vec<Value>, reqwest::Error> {
        let (_, body) = self.get(&format!("/app/ledger?user_id={user}")).await?;
        Ok(body["entries"].as_array().cloned().unwrap_or_default())
    }

    /// A session's transcript.
    pub async fn transcript(&self, user: &str, session: &str) -> Result<Value, reqwest::Error> {
        let (_, body) = self
            .get(&format!(
                "/app/transcript?user_id={user}&session_id={session}"
            ))
            .await?;
        Ok(body)
    }
}
