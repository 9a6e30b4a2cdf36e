//! Tool calls: the call, the claim's answer and the idempotency key.

use super::*;

/// A validated tool call: the execution key within a turn.
#[derive(Clone, Debug)]
pub struct ToolCall {
    /// The tool.
    pub tool: ToolName,
    /// SHA-256 of the canonical args.
    pub args_hash: Digest,
}

impl ToolCall {
    /// Validates a tool call and hashes its args.
    ///
    /// # Errors
    /// `invalid_request` when the args are over the JSON limits or not
    /// I-JSON (an integer beyond ±(2^53−1)).
    pub fn new(tool: ToolName, args: &Value) -> Result<Self> {
        crate::canonical::check_i_json("args", args)?;
        Ok(Self {
            tool,
            args_hash: crate::canonical::digest("args", args)?,
        })
    }
}

/// The answer to a tool claim.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolClaim {
    /// Run the tool, then complete or fail the execution.
    Execute {
        /// The execution.
        execution_id: ExecutionId,
        /// Stable across attempts: forward it downstream for deduplication.
        idempotency_key: String,
        /// 1 for the first claim, +1 per re-execution.
        attempt: u32,
        /// Set when an earlier attempt failed or died mid-call.
        previous_outcome: Option<PreviousOutcome>,
    },
    /// Already succeeded: here is its stored result. Do not run it.
    Cached {
        /// The execution.
        execution_id: ExecutionId,
        /// The stored result.
        result: Value,
    },
}

/// The idempotency key handed to a tool for an execution: stable across
/// attempts and takeovers because it derives from the execution's key.
pub fn idempotency_key(turn_id: &TurnId, call: &ToolCall) -> String {
    use sha2::{Digest as _, Sha256};
    let mut hasher = Sha256::new();
    for part in [
        turn_id.as_str(),
        call.tool.as_str(),
        call.args_hash.as_hex(),
    ] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    format!("agk_{}", hex::encode(&hasher.finalize()[..16]))
}
