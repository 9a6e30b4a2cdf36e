//! A holder process for the crash tests: ingests one file with an embedder
//! that takes `delay_ms` per call, so a test can SIGKILL it between
//! batches. Each embedding call is appended to `calls-log` before it is
//! made, so the test counts what the killed process paid for. Not a tool
//! for users.
//!
//! Usage: `agentgate-ingest-holder <store-url> <redis-url|-> <lease-ttl-ms> <delay-ms> <tenant> <file> <calls-log>`

use std::sync::Arc;
use std::time::Duration;

use agentgate::{Config, Gate};
use agentgate_ingest::{Embedder, IngestError, Ingestor, MediaType, OfflineEmbedder, Upload};

#[derive(Debug)]
struct Slow {
    inner: OfflineEmbedder,
    delay: Duration,
    log: std::sync::Mutex<std::fs::File>,
}

#[async_trait::async_trait]
impl Embedder for Slow {
    async fn embed(&self, texts: &[String]) -> Result<Vec<Vec<f32>>, IngestError> {
        {
            use std::io::Write;
            let mut log = self
                .log
                .lock()
                .map_err(|e| IngestError::Embedding(e.to_string()))?;
            writeln!(log, "{}", texts.len())
                .and_then(|()| log.sync_data())
                .map_err(|e| IngestError::Embedding(e.to_string()))?;
        }
        tokio::time::sleep(self.delay).await;
        self.inner.embed(texts).await
    }

    fn calls(&self) -> u64 {
        self.inner.calls()
    }

    fn texts(&self) -> u64 {
        self.inner.texts()
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, store, redis, ttl, delay, tenant, file, calls] = args.as_slice() else {
        return Err(
            "usage: agentgate-ingest-holder <store-url> <redis-url|-> <lease-ttl-ms> \
                    <delay-ms> <tenant> <file> <calls-log>"
                .into(),
        );
    };
    let config = Config {
        lease_ttl: Duration::from_millis(ttl.parse()?),
        ..Config::default()
    };
    let redis = (redis != "-").then_some(redis.as_str());
    let gate = Gate::connect(store, redis, config).await?;
    let embedder = Arc::new(Slow {
        inner: OfflineEmbedder::new(),
        delay: Duration::from_millis(delay.parse()?),
        log: std::sync::Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(calls)?,
        ),
    });
    let ingestor = Ingestor::open(gate, store, embedder).await?;
    let content = std::fs::read(file)?;
    let done = ingestor
        .ingest(&Upload {
            tenant: tenant.clone(),
            name: file.clone(),
            media_type: MediaType::detect(file, &content),
            content,
            document_id: None,
        })
        .await?;
    println!("{}", serde_json::to_string(&done)?);
    Ok(())
}
