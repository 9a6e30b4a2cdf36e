//! [`OpenAiModel`]: any OpenAI-compatible chat-completions endpoint with tool
//! calling (OpenAI, Azure-style proxies, vLLM, Ollama, LM Studio, …).
//!
//! One request per round (`stream: false`; the reply's text is forwarded as
//! one delta), a request timeout and bounded retries with exponential
//! backoff on timeouts, connection errors, 408, 429 and 5xx, honouring
//! `Retry-After` up to a cap. Other 4xx fail at once: a bad key does not get
//! better by asking again. The API key never shows in `Debug`.

use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};

use super::{DeltaSink, Message, Model, ModelError, ModelReply, ModelRequest, ToolCallRequest};
use crate::limits::{
    MODEL_MAX_RESPONSE_BYTES, MODEL_MAX_RETRIES, MODEL_MAX_RETRY_AFTER, MODEL_REQUEST_TIMEOUT,
    MODEL_RETRY_BACKOFF,
};
use crate::tools::ToolSpec;

/// The environment variable the API key is read from.
pub const API_KEY_ENV: &str = "AGENTGATE_MODEL_API_KEY";

/// Longest error body kept in a [`ModelError::Status`], in characters.
const ERROR_BODY_CHARS: usize = 300;

/// Settings of the OpenAI-compatible client.
#[derive(Clone)]
pub struct OpenAiConfig {
    /// Base URL (`https://api.openai.com/v1`) or the full
    /// `.../chat/completions` URL.
    pub url: String,
    /// The model name sent in each request.
    pub model: String,
    /// Sent as `Authorization: Bearer`; none for local servers.
    pub api_key: Option<String>,
    /// Per-request timeout.
    pub request_timeout: Duration,
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// First backoff; doubled per retry.
    pub retry_backoff: Duration,
}

impl std::fmt::Debug for OpenAiConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiConfig")
            .field("url", &self.url)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("request_timeout", &self.request_timeout)
            .field("max_retries", &self.max_retries)
            .finish_non_exhaustive()
    }
}

impl OpenAiConfig {
    /// Settings for `model` at `url`, with the API key from
    /// [`API_KEY_ENV`] (if set) and the default limits.
    pub fn new(url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            model: model.into(),
            api_key: std::env::var(API_KEY_ENV).ok().filter(|k| !k.is_empty()),
            request_timeout: MODEL_REQUEST_TIMEOUT,
            max_retries: MODEL_MAX_RETRIES,
            retry_backoff: MODEL_RETRY_BACKOFF,
        }
    }
}

/// A chat-completions client with tool calling.
#[derive(Clone, Debug)]
pub struct OpenAiModel {
    config: OpenAiConfig,
    endpoint: String,
    client: reqwest::Client,
}

impl OpenAiModel {
    /// Builds the client.
    ///
    /// # Errors
    /// `Config` when the URL is not http(s) or the HTTP client cannot be built.
    pub fn new(config: OpenAiConfig) -> Result<Self, ModelError> {
        let url = config.url.trim().trim_end_matches('/');
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(ModelError::Config(format!(
                "model url {url:?} must start with http:// or https://"
            )));
        }
        let endpoint = if url.ends_with("/chat/completions") {
            url.to_owned()
        } else {
            format!("{url}/chat/completions")
        };
        let client = reqwest::Client::builder()
            .timeout(config.request_timeout)
            .build()
            .map_err(|e| ModelError::Config(e.to_string()))?;
        Ok(Self {
            config,
            endpoint,
            client,
        })
    }

    /// The URL requests go to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
}

/// The chat-completions request body of one round.
pub(crate) fn request_body(model: &str, request: &ModelRequest<'_>) -> Value {
    let messages: Vec<Value> = request.messages.iter().map(message_json).collect();
    let tools: Vec<Value> = request.tools.iter().map(tool_json).collect();
    let mut body = json!({
        "model": model,
        "messages": messages,
        "temperature": 0,
        "stream": false,
    });
    if !tools.is_empty() {
        body["tools"] = Value::Array(tools);
        body["tool_choice"] = json!(if request.allow_tools { "auto" } else { "none" });
    }
    body
}

fn message_json(message: &Message) -> Value {
    match message {
        Message::System { content } => json!({"role": "system", "content": content}),
        Message::User { content } => json!({"role": "user", "content": content}),
        Message::Assistant {
            content,
            tool_calls,
        } => {
            let mut value = json!({"role": "assistant", "content": content});
            if !tool_calls.is_empty() {
                value["tool_calls"] = tool_calls
                    .iter()
                    .map(|call| {
                        let arguments = match &call.arguments {
                            Value::String(raw) => raw.clone(),
                            other => other.to_string(),
                        };
                        json!({
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": arguments}
                        })
                    })
                    .collect();
            }
            value
        }
        Message::Tool {
            tool_call_id,
            name,
            content,
        } => {
            json!({"role": "tool", "tool_call_id": tool_call_id, "name": name, "content": content})
        }
    }
}

fn tool_json(tool: &ToolSpec) -> Value {
    json!({
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters,
        }
    })
}

/// Reads the first choice of a chat-completions response.
pub(crate) fn parse_response(body: &Value) -> Result<ModelReply, ModelError> {
    let message = body
        .pointer("/choices/0/message")
        .ok_or_else(|| ModelError::Protocol("no choices[0].message".into()))?;
    let text = message["content"].as_str().unwrap_or_default().to_owned();
    let mut tool_calls = Vec::new();
    for (index, call) in message["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let name = call
            .pointer("/function/name")
            .and_then(Value::as_str)
            .ok_or_else(|| ModelError::Protocol(format!("tool_calls[{index}] has no name")))?;
        let id = call["id"]
            .as_str()
            .map_or_else(|| format!("call_{index}"), str::to_owned);
        // Arguments arrive as JSON text; text that does not parse is kept as
        // a string so validation can tell the model what was wrong.
        let arguments = match call.pointer("/function/arguments") {
            Some(Value::String(raw)) => {
                serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.clone()))
            }
            Some(other) => other.clone(),
            None => json!({}),
        };
        tool_calls.push(ToolCallRequest {
            id,
            name: name.to_owned(),
            arguments,
        });
    }
    Ok(ModelReply { text, tool_calls })
}

/// One attempt's failure, and whether to try again (after how long).
struct Failure {
    error: ModelError,
    retry: bool,
    retry_after: Option<Duration>,
}

fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let seconds: u64 = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(seconds).min(MODEL_MAX_RETRY_AFTER))
}

impl OpenAiModel {
    async fn attempt(&self, body: &Value) -> Result<ModelReply, Failure> {
        let mut request = self.client.post(&self.endpoint).json(body);
        if let Some(key) = &self.config.api_key {
            request = request.bearer_auth(key);
        }
        let transport = |error: reqwest::Error| Failure {
            retry: true,
            retry_after: None,
            error: if error.is_timeout() {
                ModelError::Timeout(self.config.request_timeout)
            } else {
                ModelError::Transport(error.to_string())
            },
        };
        let mut response = request.send().await.map_err(transport)?;
        let status = response.status();
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(transport)? {
            if bytes.len() + chunk.len() > MODEL_MAX_RESPONSE_BYTES {
                return Err(Failure {
                    error: ModelError::Protocol(format!(
                        "response over {MODEL_MAX_RESPONSE_BYTES} bytes"
                    )),
                    retry: false,
                    retry_after: None,
                });
            }
            bytes.extend_from_slice(&chunk);
        }
        if !status.is_success() {
            let text: String = String::from_utf8_lossy(&bytes)
                .chars()
                .take(ERROR_BODY_CHARS)
                .collect();
            return Err(Failure {
                error: ModelError::Status {
                    status: status.as_u16(),
                    body: text,
                },
                retry: status.is_server_error()
                    || status == reqwest::StatusCode::TOO_MANY_REQUESTS
                    || status == reqwest::StatusCode::REQUEST_TIMEOUT,
                retry_after: retry_after(response.headers()),
            });
        }
        let value: Value = serde_json::from_slice(&bytes).map_err(|e| Failure {
            error: ModelError::Protocol(format!("response is not JSON: {e}")),
            retry: false,
            retry_after: None,
        })?;
        parse_response(&value).map_err(|error| Failure {
            error,
            retry: false,
            retry_after: None,
        })
    }
}

#[async_trait]
impl Model for OpenAiModel {
    fn name(&self) -> &str {
        &self.config.model
    }

    async fn complete(
        &self,
        request: ModelRequest<'_>,
        deltas: DeltaSink<'_>,
    ) -> Result<ModelReply, ModelError> {
        let body = request_body(&self.config.model, &request);
        let mut backoff = self.config.retry_backoff;
        let mut attempt = 0;
        loop {
            match self.attempt(&body).await {
                Ok(reply) => {
                    if !reply.text.is_empty() {
                        deltas(&reply.text);
                    }
                    return Ok(reply);
                }
                Err(failure) if failure.retry && attempt < self.config.max_retries => {
                    attempt += 1;
                    let wait = failure.retry_after.unwrap_or(backoff);
                    tracing::warn!(error = %failure.error, attempt, wait_ms = wait.as_millis(), "model request failed; retrying");
                    tokio::time::sleep(wait).await;
                    backoff *= 2;
                }
                Err(failure) => return Err(failure.error),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::specs;

    #[test]
    fn request_maps_messages_tools_and_the_last_round() {
        let messages = vec![
            Message::System {
                content: "sys".into(),
            },
            Message::User {
                content: "午饭 35".into(),
            },
            Message::Assistant {
                content: String::new(),
                tool_calls: vec![ToolCallRequest {
                    id: "c1".into(),
                    name: "list_categories".into(),
                    arguments: json!({"type": "expense"}),
                }],
            },
            Message::Tool {
                tool_call_id: "c1".into(),
                name: "list_categories".into(),
                content: "{\"ok\":true}".into(),
            },
        ];
        let tools = specs();
        let request = ModelRequest {
            messages: &messages,
            tools: &tools,
            allow_tools: false,
        };
        let body = request_body("m", &request);
        assert_eq!(body["model"], "m");
        assert_eq!(body["tool_choice"], "none");
        assert_eq!(body["tools"][1]["function"]["name"], "create_transaction");
        assert_eq!(
            body["messages"][2]["tool_calls"][0]["function"]["arguments"],
            "{\"type\":\"expense\"}"
        );
        assert_eq!(body["messages"][3]["role"], "tool");
        assert_eq!(body["messages"][3]["tool_call_id"], "c1");
    }

    #[test]
    fn response_tool_calls_parse_and_bad_arguments_stay_text() {
        let body = json!({"choices": [{"message": {"content": null, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "create_transaction", "arguments": "{\"type\":\"expense\",\"amount\":35}"}},
            {"id": "b", "type": "function", "function": {"name": "create_transaction", "arguments": "{oops"}}
        ]}}]});
        let reply = parse_response(&body).expect("parses");
        assert_eq!(reply.text, "");
        assert_eq!(
            reply.tool_calls[0].arguments,
            json!({"type": "expense", "amount": 35})
        );
        assert_eq!(reply.tool_calls[1].arguments, json!("{oops"));
        assert!(parse_response(&json!({"choices": []})).is_err());
    }

    #[test]
    fn urls_and_debug() {
        let mut config = OpenAiConfig::new("http://127.0.0.1:1/v1/", "m");
        config.api_key = Some("sk-secret".into());
        let model = OpenAiModel::new(config.clone()).expect("builds");
        assert_eq!(model.endpoint(), "http://127.0.0.1:1/v1/chat/completions");
        assert!(!format!("{model:?}").contains("sk-secret"));
        config.url = "ftp://x".into();
        assert!(OpenAiModel::new(config).is_err());
    }
}
