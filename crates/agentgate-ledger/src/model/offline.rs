//! [`OfflineModel`]: the built-in model. Deterministic, no network; it reads
//! messages with [`super::parse_message`] and speaks the same tool-calling
//! protocol as a real model, in the QingLedger order (seed 000):
//!
//! 1. `list_categories` for each type the message needs;
//! 2. one `create_transaction` per entry, naming a listed category when the
//!    words contain one, else passing the words for the server to resolve;
//! 3. a text reply built from the tool results (errors included).
//!
//! A message with no amount that asks something is searched in the user's
//! documents (`search_documents`), and answered from the closest passage,
//! cited by file and section.
//!
//! A configurable think time before each round mimics a slow LLM, so the
//! concurrency problems the engine solves are visible in the demo.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{json, Value};

use super::parse::{parse_message, ParsedEntry};
use super::{DeltaSink, Message, Model, ModelError, ModelReply, ModelRequest, ToolCallRequest};
use crate::limits::MAX_DELTAS_PER_ROUND;
use crate::records::EntryType;
use crate::tools::{CREATE_TRANSACTION, LIST_CATEGORIES, SEARCH_DOCUMENTS};

/// The deterministic built-in model.
#[derive(Clone, Debug)]
pub struct OfflineModel {
    think_time: Duration,
}

impl Default for OfflineModel {
    fn default() -> Self {
        Self::new(Self::DEFAULT_THINK_TIME)
    }
}

impl OfflineModel {
    /// Think time per round by default: a booking takes three rounds, so a
    /// turn takes about two seconds, like a fast hosted LLM (docs/protocol.md §11).
    pub const DEFAULT_THINK_TIME: Duration = Duration::from_millis(700);

    /// A model that thinks `think_time` before each round (tests use zero).
    pub fn new(think_time: Duration) -> Self {
        Self { think_time }
    }
}

/// What the conversation since the person's last message holds.
struct State<'a> {
    user_text: &'a str,
    calls: Vec<&'a ToolCallRequest>,
    results: HashMap<&'a str, Value>,
    round: usize,
}

fn read_state(messages: &[Message]) -> State<'_> {
    let last_user = messages
        .iter()
        .enumerate()
        .rev()
        .find_map(|(index, message)| match message {
            Message::User { content } => Some((index, content.as_str())),
            _ => None,
        });
    let (user_text, after) = match last_user {
        Some((index, text)) => (text, &messages[index + 1..]),
        None => ("", messages),
    };
    let mut state = State {
        user_text,
        calls: Vec::new(),
        results: HashMap::new(),
        round: 1,
    };
    for message in after {
        match message {
            Message::Assistant { tool_calls, .. } => {
                state.round += 1;
                state.calls.extend(tool_calls);
            }
            Message::Tool {
                tool_call_id,
                content,
                ..
            } => {
                let value = serde_json::from_str(content).unwrap_or(Value::Null);
                state.results.insert(tool_call_id.as_str(), value);
            }
            Message::System { .. } | Message::User { .. } => {}
        }
    }
    state
}

fn is_chinese(text: &str) -> bool {
    text.chars().any(|c| ('\u{4e00}'..='\u{9fff}').contains(&c))
}

fn call(round: usize, index: usize, name: &str, arguments: Value) -> ToolCallRequest {
    ToolCallRequest {
        id: format!("call_{round}_{index}"),
        name: name.to_owned(),
        arguments,
    }
}

fn list_calls(round: usize, entries: &[ParsedEntry]) -> Vec<ToolCallRequest> {
    let mut kinds: Vec<EntryType> = Vec::new();
    for entry in entries {
        if !kinds.contains(&entry.kind) {
            kinds.push(entry.kind);
        }
    }
    kinds
        .iter()
        .enumerate()
        .map(|(i, kind)| call(round, i, LIST_CATEGORIES, json!({"type": kind.as_str()})))
        .collect()
}

/// Category names listed by earlier `list_categories` results, per type.
fn listed_names(state: &State<'_>) -> Vec<(String, String)> {
    let mut names = Vec::new();
    for call in state.calls.iter().filter(|c| c.name == LIST_CATEGORIES) {
        let Some(result) = state.results.get(call.id.as_str()) else {
            continue;
        };
        let kind = result["type"].as_str().unwrap_or_default().to_owned();
        for category in result["categories"].as_array().into_iter().flatten() {
            if let Some(name) = category["name"].as_str() {
                names.push((kind.clone(), name.to_owned()));
            }
        }
    }
    names
}

fn create_calls(round: usize, entries: &[ParsedEntry], state: &State<'_>) -> Vec<ToolCallRequest> {
    let listed = listed_names(state);
    entries
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            let amount = serde_json::from_str::<serde_json::Number>(&entry.amount)
                .map_or_else(|_| Value::String(entry.amount.clone()), Value::Number);
            let mut args = json!({"type": entry.kind.as_str(), "amount": amount});
            if !entry.hint.is_empty() {
                // Name a listed category the words contain; otherwise pass the
                // words and let the server's synonyms decide.
                let named = listed
                    .iter()
                    .find(|(kind, name)| {
                        kind == entry.kind.as_str() && entry.hint.contains(name.as_str())
                    })
                    .map_or(entry.hint.as_str(), |(_, name)| name.as_str());
                args["category_name"] = json!(named);
                args["note"] = json!(entry.hint);
            }
            if let Some(date) = &entry.date {
                args["occur_date"] = json!(date);
            }
            call(round, i, CREATE_TRANSACTION, args)
        })
        .collect()
}

fn summary(state: &State<'_>, chinese: bool) -> String {
    let mut lines = Vec::new();
    for call in state.calls.iter().filter(|c| c.name == CREATE_TRANSACTION) {
        let result = state
            .results
            .get(call.id.as_str())
            .cloned()
            .unwrap_or(Value::Null);
        let line = if result["ok"] == json!(true) {
            let entry = &result["entry"];
            let (category, amount, date) = (
                entry["category"].as_str().unwrap_or("?"),
                entry["amount"].as_str().unwrap_or("?"),
                entry["occur_date"].as_str().unwrap_or("?"),
            );
            let note = entry["note"].as_str().filter(|n| !n.is_empty());
            let category = if chinese {
                category
            } else {
                crate::category::english_name(category)
            };
            match (chinese, note) {
                (true, Some(note)) => format!("已记账：{category} {amount} 元（{note}，{date}）"),
                (true, None) => format!("已记账：{category} {amount} 元（{date}）"),
                (false, Some(note)) => format!("Booked: {category} {amount} ({note}, {date})"),
                (false, None) => format!("Booked: {category} {amount} ({date})"),
            }
        } else {
            let error = result["error"].as_str().unwrap_or("no result");
            if chinese {
                format!("没有记账：{error}")
            } else {
                format!("Not booked: {error}")
            }
        };
        lines.push(line);
    }
    if lines.is_empty() {
        return if chinese {
            "抱歉，这次没能记账，请换个说法再试一次。".to_owned()
        } else {
            "Sorry, nothing was booked this time; please try rephrasing.".to_owned()
        };
    }
    lines.join("\n")
}

/// Whether a message with no amount asks something the documents may
/// answer: a question mark, a question word first, or a Chinese question
/// word anywhere.
fn is_question(text: &str) -> bool {
    const ENGLISH: [&str; 13] = [
        "what", "how", "when", "which", "who", "where", "why", "can", "is", "are", "do", "does",
        "may",
    ];
    const CHINESE: [&str; 8] = [
        "什么",
        "怎么",
        "多少",
        "能不能",
        "可以",
        "是否",
        "吗",
        "规定",
    ];
    let lower = text.to_lowercase();
    text.contains(['?', '？'])
        || lower
            .split_whitespace()
            .next()
            .is_some_and(|first| ENGLISH.contains(&first))
        || lower.contains("policy")
        || CHINESE.iter().any(|word| text.contains(word))
}

/// The reply to a question from the search's result: the closest passage,
/// cited by its file and section.
fn answer(state: &State<'_>, chinese: bool) -> String {
    let result = state
        .calls
        .iter()
        .filter(|c| c.name == SEARCH_DOCUMENTS)
        .find_map(|c| state.results.get(c.id.as_str()))
        .cloned()
        .unwrap_or(Value::Null);
    let first = &result["passages"][0];
    match (first["name"].as_str(), first["text"].as_str()) {
        (Some(name), Some(passage)) => {
            let text = best_sentence(passage, state.user_text);
            let section = first["section"].as_u64().unwrap_or(1);
            if chinese {
                format!("根据《{name}》第 {section} 段：{text}")
            } else {
                format!("From {name}, section {section}: {text}")
            }
        }
        _ if result["ok"] == json!(true) => {
            if chinese {
                "你上传的文档里没有找到相关内容。".to_owned()
            } else {
                "I found nothing about that in your documents.".to_owned()
            }
        }
        _ => help(chinese),
    }
}

/// The sentence of `passage` that shares the most words with `question`
/// (the first on a tie): what a person asked about, not the whole passage.
fn best_sentence<'a>(passage: &'a str, question: &str) -> &'a str {
    let words = |text: &str| -> Vec<String> {
        text.split(|c: char| !c.is_alphanumeric())
            .filter(|w| w.chars().count() > 2)
            .map(str::to_lowercase)
            .collect()
    };
    let asked = words(question);
    passage
        .split_inclusive(['.', '。', '\n', '!', '?', '！', '？'])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .max_by_key(|sentence| {
            let shared = words(sentence).iter().filter(|w| asked.contains(w)).count();
            // Earlier sentences win ties: `max_by_key` keeps the last maximum.
            (shared, std::cmp::Reverse(passage.find(*sentence)))
        })
        .unwrap_or(passage)
}

fn help(chinese: bool) -> String {
    if chinese {
        "我没看到金额。可以这样说：「午饭 35，打车 18」或「昨天工资 8000」。".to_owned()
    } else {
        "I did not see an amount. Try \"lunch 35, taxi 18\" or \"salary 8000 yesterday\"."
            .to_owned()
    }
}

impl OfflineModel {
    async fn stream(&self, text: &str, deltas: DeltaSink<'_>) {
        let chars: Vec<char> = text.chars().collect();
        let size = chars.len().div_ceil(MAX_DELTAS_PER_ROUND).max(4);
        let pause = self.think_time / 20;
        for chunk in chars.chunks(size) {
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            deltas(&chunk.iter().collect::<String>());
        }
    }
}

#[async_trait]
impl Model for OfflineModel {
    fn name(&self) -> &str {
        "offline"
    }

    async fn complete(
        &self,
        request: ModelRequest<'_>,
        deltas: DeltaSink<'_>,
    ) -> Result<ModelReply, ModelError> {
        if !self.think_time.is_zero() {
            tokio::time::sleep(self.think_time).await;
        }
        let state = read_state(request.messages);
        let chinese = is_chinese(state.user_text);
        let entries = parse_message(state.user_text);
        let listed = state.calls.iter().any(|c| c.name == LIST_CATEGORIES);
        let created = state.calls.iter().any(|c| c.name == CREATE_TRANSACTION);
        let searched = state.calls.iter().any(|c| c.name == SEARCH_DOCUMENTS);
        let question = entries.is_empty() && is_question(state.user_text);
        let tool_calls = match (request.allow_tools, entries.is_empty(), listed, created) {
            (true, false, false, false) => list_calls(state.round, &entries),
            (true, false, true, false) => create_calls(state.round, &entries, &state),
            (true, true, _, _) if question && !searched => vec![call(
                state.round,
                0,
                SEARCH_DOCUMENTS,
                json!({"query": state.user_text}),
            )],
            _ => Vec::new(),
        };
        if !tool_calls.is_empty() {
            return Ok(ModelReply {
                text: String::new(),
                tool_calls,
            });
        }
        let text = if searched {
            answer(&state, chinese)
        } else if entries.is_empty() {
            help(chinese)
        } else {
            summary(&state, chinese)
        };
        self.stream(&text, deltas).await;
        Ok(ModelReply {
            text,
            tool_calls: Vec::new(),
        })
    }
}

#[cfg(test)]
mod question_tests {
    use super::is_question;

    #[test]
    fn questions_are_told_from_bookings_and_chatter() {
        for asked in [
            "How much is a taxi refunded?",
            "what does the travel policy say about lunch",
            "打车能报销多少",
            "午饭可以报销吗",
        ] {
            assert!(is_question(asked), "{asked}");
        }
        for said in ["hello", "thanks a lot", "好的"] {
            assert!(!is_question(said), "{said}");
        }
    }
}

#[cfg(test)]
mod answer_tests {
    use super::best_sentence;

    #[test]
    fn the_answer_is_the_sentence_the_question_is_about() {
        let passage = "Rule 1: taxis are refunded. Lunch with a client is refunded once a week. \
                       Rule 2: hotels are refunded.";
        assert_eq!(
            best_sentence(passage, "Is lunch with a client refunded?"),
            "Lunch with a client is refunded once a week."
        );
        assert_eq!(
            best_sentence("One line only", "nothing shared"),
            "One line only"
        );
    }
}
