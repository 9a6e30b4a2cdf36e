//! A child process for the conformance suite; see `agentgate_conformance::holder`.
//!
//! Usage: `agentgate-holder <store_url> <redis_url or -> <user> <session> <request> <ttl_ms>`

#[tokio::main]
async fn main() -> Result<(), agentgate::BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    agentgate_conformance::holder::hold_from_args(&args).await
}
