//! A turn's event log: what a holder appends and what followers read.

use super::*;

/// An event a turn's holder appends to the turn's log (docs/protocol.md §9).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewEvent {
    /// Its name: an SSE `event:` token ([`NewEvent::new`] checks it).
    pub name: String,
    /// Its data, canonical JSON (I-JSON, as every payload).
    pub data: CanonicalJson,
}

/// Event names a turn's stream itself sends (`GET /v1/turns/{id}/events`
/// ends with `end`, or `error` when the read fails), so no appended event
/// may take them: a reader could not tell a holder's `end` from the
/// stream's.
pub const RESERVED_EVENT_NAMES: [&str; 2] = ["end", "error"];

impl NewEvent {
    /// Validates an event: a name of 1 to
    /// [`crate::limits::MAX_EVENT_NAME_BYTES`] bytes of ASCII letters,
    /// digits, `_`, `-`, `.` or `:` (it becomes an SSE line, so nothing
    /// that could end one), not one of [`RESERVED_EVENT_NAMES`], and data of at most
    /// [`crate::limits::MAX_EVENT_DATA_BYTES`] canonical bytes.
    ///
    /// # Errors
    /// `invalid_request` for a bad name, data that is not I-JSON, or data
    /// over its limit.
    pub fn new(name: &str, data: &serde_json::Value) -> Result<Self> {
        let max = crate::limits::MAX_EVENT_NAME_BYTES;
        let token = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':');
        if name.is_empty() || name.len() > max || !name.chars().all(token) {
            return Err(Error::invalid(format!(
                "an event name is 1 to {max} letters, digits, '_', '-', '.' or ':'"
            )));
        }
        if RESERVED_EVENT_NAMES.contains(&name) {
            return Err(Error::invalid(format!(
                "the event name {name:?} is reserved: the stream itself sends it"
            )));
        }
        let data = CanonicalJson::new("event data", data)?;
        let limit = crate::limits::MAX_EVENT_DATA_BYTES;
        if data.as_str().len() > limit {
            return Err(Error::invalid(format!(
                "event data is {} bytes, the limit is {limit}",
                data.as_str().len()
            )));
        }
        Ok(Self {
            name: name.to_owned(),
            data,
        })
    }

    /// The bytes it counts against its turn's limit.
    pub fn size(&self) -> u64 {
        (self.name.len() + self.data.as_str().len()) as u64
    }
}

/// An event of a turn's log, as readers see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TurnEvent {
    /// Its id: 1 for the turn's first event, then one more each; never
    /// reused, so a reader resumes after the last id it saw.
    pub event_id: u64,
    /// The attempt of the turn whose holder appended it (a takeover's
    /// events carry the new attempt).
    pub attempt: u32,
    /// Its name.
    pub name: String,
    /// Its data, canonical JSON text.
    pub data: String,
}

/// A page of a turn's events after an id, with the turn's state read
/// before them: when that state is an ending, no event follows the page's
/// last one unless the page was full.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventPage {
    /// The turn's state, read before the events.
    pub state: TurnState,
    /// Its attempt, read with the state.
    pub attempt: u32,
    /// The events after the asked id, in id order, at most the page size.
    pub events: Vec<TurnEvent>,
}
