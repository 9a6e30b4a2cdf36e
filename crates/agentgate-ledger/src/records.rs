//! The ledger's records and the views the UI reads. All serialize to the JSON
//! the server sends; amounts go out both as integer cents and as two-decimal
//! text so a page never does float arithmetic on money.

use agentgate::{Decision, TurnState, TurnView};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Income or expense. The ledger's "type"; in Rust `kind`, since `type` is
/// a keyword.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryType {
    /// Money in.
    Income,
    /// Money out.
    Expense,
}

impl EntryType {
    /// The stored and wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Income => "income",
            Self::Expense => "expense",
        }
    }

    /// Parses the stored and wire name.
    pub fn parse(text: &str) -> Option<Self> {
        match text.trim().to_ascii_lowercase().as_str() {
            "income" => Some(Self::Income),
            "expense" => Some(Self::Expense),
            _ => None,
        }
    }
}

/// A validated entry waiting to be booked: what `create_transaction`'s
/// arguments mean after validation and category resolution. Also what a
/// pending confirmation carries.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewEntry {
    /// Income or expense.
    #[serde(rename = "type")]
    pub kind: EntryType,
    /// Amount in cents, above zero.
    pub amount_cents: i64,
    /// The resolved category's name.
    pub category: String,
    /// The person's words, cut to the note limit.
    pub note: String,
    /// `YYYY-MM-DD`.
    pub occur_date: String,
}

/// A booked ledger entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// The entry's id in the ledger table.
    pub id: i64,
    /// Income or expense.
    #[serde(rename = "type")]
    pub kind: EntryType,
    /// Amount in cents.
    pub amount_cents: i64,
    /// The amount as text with two decimals.
    pub amount: String,
    /// The category's name.
    pub category: String,
    /// The note.
    pub note: String,
    /// `YYYY-MM-DD`.
    pub occur_date: String,
    /// The session the entry was booked from.
    pub session_id: String,
    /// The turn that booked it.
    pub turn_id: String,
    /// Store-clock insert time, ms since the Unix epoch.
    pub created_at_ms: i64,
}

/// What a turn answered: stored as the turn's response (or, for a turn that
/// waits for confirmation, as its pending action), so a replay returns it
/// unchanged.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    /// The assistant's text.
    pub text: String,
    /// Entries booked by this turn.
    #[serde(default)]
    pub entries: Vec<Entry>,
    /// Entries waiting for the person's approval (non-empty only on a turn
    /// that ended awaiting confirmation).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pending: Vec<NewEntry>,
    /// Whether the person wrote in Chinese, so the turn that answers this
    /// one's confirmation replies in the same language. Absent in replies
    /// stored before it was kept: the text's script decides then, which
    /// the Chinese category names in an English text fool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chinese: Option<bool>,
}

impl Reply {
    /// Reads a reply stored by this app; `None` for anything else.
    pub fn from_value(value: &Value) -> Option<Self> {
        serde_json::from_value(value.clone()).ok()
    }
}

/// How a message or confirmation turn ended, as the caller sees it: the same
/// for a fresh run and a replay.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatOutcome {
    /// The turn.
    pub turn_id: String,
    /// The client's id of the request that started the turn: on a replay
    /// of a second confirmation it is the first answer's, not the caller's.
    #[serde(default)]
    pub client_request_id: String,
    /// Its state: `succeeded`, `awaiting_confirmation`, `confirmed` (a
    /// pending turn that was since answered), `failed`, `cancelled`,
    /// `superseded`, or `queued` (a message waiting behind a running reply,
    /// from [`crate::LedgerApp::chat`]).
    pub state: TurnState,
    /// Whether this is a stored outcome returned again (no model call, no
    /// booking).
    pub replayed: bool,
    /// The reply, for every state but `failed`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reply: Option<Reply>,
    /// For `failed`: the stored error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<Value>,
    /// For `confirmed`: the confirmation turn that took the decision.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confirmed_by: Option<String>,
    /// For a confirmation turn: the decision it carried out. A second
    /// answer to the same pending turn replays the first one's outcome, so
    /// a page compares this with what it sent to tell the person whose
    /// answer was applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<Decision>,
}

impl ChatOutcome {
    /// The outcome of an ended turn from the engine's view of it.
    pub fn from_view(view: &TurnView, replayed: bool) -> Self {
        let reply = match view.state {
            TurnState::Succeeded | TurnState::Cancelled => {
                view.response.as_ref().and_then(Reply::from_value)
            }
            TurnState::AwaitingConfirmation | TurnState::Confirmed => {
                view.pending.as_ref().and_then(Reply::from_value)
            }
            TurnState::Failed
            | TurnState::Running
            | TurnState::Abandoned
            | TurnState::Queued
            | TurnState::Superseded => None,
        };
        Self {
            turn_id: view.turn_id.to_string(),
            client_request_id: view.client_request_id.as_str().to_owned(),
            state: view.state,
            replayed,
            reply,
            error: view.error.clone(),
            confirmed_by: view.confirmed_by.as_ref().map(ToString::to_string),
            decision: view.confirmation.as_ref().map(|c| c.decision),
        }
    }
}

/// A category as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Category {
    /// Income or expense.
    #[serde(rename = "type")]
    pub kind: EntryType,
    /// Its name, unique within its type.
    pub name: String,
    /// Words that mean this category (午饭 → 餐饮).
    pub synonyms: Vec<String>,
    /// Whether unmatched entries of this type land here.
    pub is_default: bool,
}

/// One conversation of a user, for the session list.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionSummary {
    /// The session.
    pub session_id: String,
    /// The first message, as a title.
    pub title: String,
    /// Turns so far.
    pub turns: i64,
    /// Store-clock time of the latest message, ms since the Unix epoch.
    pub last_message_at_ms: i64,
}

/// One turn of a conversation: the person's message and the answer, with
/// the turn's state from the engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TranscriptTurn {
    /// The turn.
    pub turn_id: String,
    /// The client's id of the request that started the turn, so a page can
    /// offer a retry of a failed turn as that same request (never a new
    /// one that could book twice); `None` once the engine swept the turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_request_id: Option<String>,
    /// What the person sent (for a confirmation turn: "确认" or "取消").
    pub user_text: String,
    /// For a confirmation turn: the pending turn it answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confirms: Option<String>,
    /// The answer, once the turn ended with one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reply: Option<Reply>,
    /// The engine's state of the turn; `None` once the engine's retention
    /// swept it (the transcript is kept longer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<TurnState>,
    /// For a failed turn: its error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<Value>,
    /// For a failed turn: whether a repeat of its request runs it again
    /// (else the repeat replays the failure).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retryable: Option<bool>,
    /// The engine's attempts of the turn: 0 for one that never started (a
    /// queued message, and one cancelled or superseded before it ran);
    /// `None` once the engine swept it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// Store-clock time of the message, ms since the Unix epoch.
    pub created_at_ms: i64,
}

/// The total of one category.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CategoryTotal {
    /// Income or expense.
    #[serde(rename = "type")]
    pub kind: EntryType,
    /// The category.
    pub category: String,
    /// Entries in it.
    pub count: i64,
    /// Their sum in cents.
    pub amount_cents: i64,
    /// Their sum as text.
    pub amount: String,
}

/// A user's totals: per category, and income and expense overall.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Totals {
    /// Per category, largest first.
    pub categories: Vec<CategoryTotal>,
    /// All income, in cents.
    pub income_cents: i64,
    /// All expense, in cents.
    pub expense_cents: i64,
    /// All income, as text.
    pub income: String,
    /// All expense, as text.
    pub expense: String,
}
