//! The engine through the library: `Gate::begin` → `Turn::tool` →
//! `Execution::complete` → `Turn::succeed`, exactly as an agent backend in
//! Rust calls it (watchdog included).

use std::time::Duration;

use agentgate::{Begun, Gate, ToolStep};
use async_trait::async_trait;
use serde_json::Value;

use crate::error::{BenchError, Result};
use crate::workload::{next_request, session_of, timed, user_of, TurnLoop, STEPS};

/// The JSON a bench turn carries: small, like a chat message, a tool call
/// and their answers.
#[derive(Clone, Debug)]
pub(crate) struct Bodies {
    pub payload: Value,
    pub args: Value,
    pub result: Value,
    pub response: Value,
}

impl Default for Bodies {
    fn default() -> Self {
        Self {
            payload: serde_json::json!({"text": "taxi 18 yesterday"}),
            args: serde_json::json!({"type": "expense", "amount": 18, "category_name": "交通"}),
            result: serde_json::json!({"entry_id": 7, "amount": "18.00"}),
            response: serde_json::json!({"text": "booked 18.00 under 交通"}),
        }
    }
}

/// The tool every bench turn claims.
pub(crate) const TOOL: &str = "create_transaction";

/// Turns through a [`Gate`].
#[derive(Debug)]
pub(crate) struct LibraryTurns {
    gate: Gate,
    bodies: Bodies,
}

impl LibraryTurns {
    pub(crate) fn new(gate: Gate) -> Self {
        Self {
            gate,
            bodies: Bodies::default(),
        }
    }
}

#[async_trait]
impl TurnLoop for LibraryTurns {
    async fn turn(&self, client: usize, timings: &mut [Duration; STEPS]) -> Result<()> {
        let [begin_ms, claim_ms, complete_ms, end_ms] = timings;
        let request = format!("r{}", next_request());
        let begun = timed(
            begin_ms,
            self.gate.begin(
                &user_of(client),
                &session_of(client),
                &request,
                &self.bodies.payload,
            ),
        )
        .await?;
        let Begun::Started(turn) = begun else {
            return Err(BenchError::unexpected(format!(
                "begin of a new request {request} replayed"
            )));
        };
        let step = timed(claim_ms, turn.tool(TOOL, &self.bodies.args)).await?;
        let ToolStep::Execute(execution) = step else {
            return Err(BenchError::unexpected("a new tool call was cached"));
        };
        timed(complete_ms, execution.complete(&self.bodies.result)).await?;
        timed(end_ms, turn.succeed(&self.bodies.response))
            .await
            .map_err(agentgate::Error::from)?;
        Ok(())
    }
}
