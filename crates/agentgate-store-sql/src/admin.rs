//! Reaching a database server for a one-off administrative connection
//! (creating and dropping databases, `agentgate conformance`'s scratch
//! stores): a connection attempt bounded by [`CONNECT_TIMEOUT`], its failure
//! one line for a person with the password redacted.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use agentgate_core::dburl::redact_password as redact;

/// How long a server has to answer before it counts as unreachable.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs `connect` (a connection attempt to `url`) under
/// [`CONNECT_TIMEOUT`], naming the server, never its password, on failure.
///
/// # Errors
/// The server refused (its error), or gave no answer in time.
pub async fn reach<C, E: Display>(
    url: &str,
    connect: impl Future<Output = Result<C, E>>,
) -> Result<C, String> {
    match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(error)) => Err(format!("cannot connect to {}: {error}", redact(url))),
        Err(_) => Err(format!(
            "no answer from {} within {} s",
            redact(url),
            CONNECT_TIMEOUT.as_secs()
        )),
    }
}
