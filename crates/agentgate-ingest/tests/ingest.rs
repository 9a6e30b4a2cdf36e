//! Seed 003's incidents, attacked on every store the ingestion runs on
//! (SQLite and PostgreSQL, each with and without the Redis lease layer):
//! uploads of one file at once, a holder SIGKILLed between batches, and
//! updates under a stream of queries. Without a server a target skips with
//! a printed reason, unless `AGENTGATE_REQUIRE_SERVICES=1`.

#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use agentgate::Config;
use agentgate_conformance::targets::{self, Target};
use agentgate_ingest::limits::EMBED_BATCH;
use agentgate_ingest::{Embedder, Ingested, Ingestor, MediaType, OfflineEmbedder, Upload};
use tokio::sync::Barrier;

/// A document of `paragraphs` paragraphs, distinct per `seed`.
fn document(seed: &str, paragraphs: usize) -> Vec<u8> {
    (0..paragraphs)
        .map(|i| {
            format!(
                "{seed} receipt {i}: lunch with the team at the harbour cafe, paid by card, \
                 total {i}.50 euros, category meals, refundable under policy section {i}."
            )
        })
        .collect::<Vec<_>>()
        .join("\n\n")
        .into_bytes()
}

/// `text` as a PDF: its paragraphs set in Helvetica, `per_page` to a page.
/// Written by hand (objects, then a cross-reference table of their byte
/// offsets), so the test depends on the parser alone.
fn pdf(text: &[u8], per_page: usize) -> Vec<u8> {
    let text = std::str::from_utf8(text).unwrap();
    let paragraphs: Vec<&str> = text.split("\n\n").collect();
    let pages: Vec<&[&str]> = paragraphs.chunks(per_page).collect();
    let escape = |line: &str| {
        line.replace('\\', "\\\\")
            .replace('(', "\\(")
            .replace(')', "\\)")
    };
    let kids: Vec<String> = (0..pages.len())
        .map(|i| format!("{} 0 R", 4 + 2 * i))
        .collect();
    let mut objects = vec![
        "<< /Type /Catalog /Pages 2 0 R >>".to_owned(),
        format!(
            "<< /Type /Pages /Kids [{}] /Count {} >>",
            kids.join(" "),
            pages.len()
        ),
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>"
            .to_owned(),
    ];
    for (i, page) in pages.iter().enumerate() {
        let mut content = String::from("BT /F1 9 Tf 14 TL 40 800 Td\n");
        for paragraph in *page {
            content.push_str(&format!("({}) Tj T* T*\n", escape(paragraph)));
        }
        content.push_str("ET");
        objects.push(format!(
            "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 595 842] \
             /Resources << /Font << /F1 3 0 R >> >> /Contents {} 0 R >>",
            5 + 2 * i
        ));
        objects.push(format!(
            "<< /Length {} >>\nstream\n{content}\nendstream",
            content.len()
        ));
    }
    let mut out = b"%PDF-1.4\n".to_vec();
    let mut offsets = Vec::new();
    for (i, object) in objects.iter().enumerate() {
        offsets.push(out.len());
        out.extend(format!("{} 0 obj\n{object}\nendobj\n", i + 1).bytes());
    }
    let xref = out.len();
    out.extend(format!("xref\n0 {}\n0000000000 65535 f \n", objects.len() + 1).bytes());
    for offset in offsets {
        out.extend(format!("{offset:010} 00000 n \n").bytes());
    }
    out.extend(
        format!(
            "trailer\n<< /Size {} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n",
            objects.len() + 1
        )
        .bytes(),
    );
    out
}

fn upload(tenant: &str, name: &str, content: &[u8]) -> Upload {
    Upload {
        tenant: tenant.to_owned(),
        name: name.to_owned(),
        media_type: MediaType::detect(name, content),
        content: content.to_vec(),
        document_id: None,
    }
}

async fn all_targets() -> Vec<Target> {
    let mut all = Vec::new();
    all.extend(targets::sqlite().await);
    all.extend(targets::sqlite_redis().await);
    all.extend(targets::postgres().await);
    all.extend(targets::postgres_redis().await);
    all
}

async fn ingestor(target: &Target, config: Config) -> (Ingestor, Arc<OfflineEmbedder>) {
    let embedder = Arc::new(OfflineEmbedder::new());
    let gate = target.gate(config).await;
    let ingestor = Ingestor::open(gate, &target.store_url, embedder.clone())
        .await
        .unwrap();
    (ingestor, embedder)
}

/// How many turns the store holds for the document's session.
async fn turns_of(target: &Target, document_id: &str) -> i64 {
    let session = format!("ingest:{document_id}");
    let sql = "SELECT COUNT(*) FROM ag_turns WHERE session_id = $1";
    if target.store_url.starts_with("sqlite:") {
        let pool = sqlx::SqlitePool::connect(&target.store_url).await.unwrap();
        sqlx::query_scalar(sql)
            .bind(&session)
            .fetch_one(&pool)
            .await
            .unwrap()
    } else {
        let pool = sqlx::PgPool::connect(&target.store_url).await.unwrap();
        sqlx::query_scalar(sql)
            .bind(&session)
            .fetch_one(&pool)
            .await
            .unwrap()
    }
}

/// `uploads` uploads of one file behind a barrier.
async fn at_once(ingestor: &Ingestor, uploads: usize, one: &Upload) -> Vec<Ingested> {
    let barrier = Arc::new(Barrier::new(uploads));
    let tasks: Vec<_> = (0..uploads)
        .map(|_| {
            let (ingestor, one, barrier) = (ingestor.clone(), one.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                ingestor.ingest(&one).await
            })
        })
        .collect();
    let mut done = Vec::new();
    for task in tasks {
        done.push(task.await.unwrap().unwrap());
    }
    done
}

/// Three uploads of one PDF at once (seed 003's triple click), then a
/// storm of 50 of a text file: each is one ingestion, every caller gets the
/// same document, the embedder is paid once per chunk, and the index holds
/// each chunk once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn uploads_of_one_file_at_once_make_one_ingestion() {
    for target in all_targets().await {
        let (ingestor, embedder) = ingestor(&target, Config::default()).await;
        for (uploads, seed, kind) in [(3, "triple", "pdf"), (50, "storm", "txt")] {
            let (calls, texts) = (embedder.calls(), embedder.texts());
            let text = document(seed, 120);
            let content = if kind == "pdf" { pdf(&text, 40) } else { text };
            let file = upload("acme", &format!("{seed}.{kind}"), &content);
            assert_eq!(file.media_type == MediaType::Pdf, kind == "pdf", "{file:?}");
            let done = at_once(&ingestor, uploads, &file).await;
            let first = done[0].clone();
            assert!(
                done.iter().all(|d| *d == first),
                "{}: {done:?}",
                target.name
            );
            let chunks = u64::try_from(first.chunks).unwrap();
            let batches = chunks.div_ceil(EMBED_BATCH as u64);
            assert!(batches > 1, "the document spans batches");
            assert_eq!(
                embedder.texts() - texts,
                chunks,
                "{}: texts embedded",
                target.name
            );
            assert_eq!(
                embedder.calls() - calls,
                batches,
                "{}: embedding calls",
                target.name
            );
            assert_eq!(
                turns_of(&target, &first.document_id).await,
                1,
                "{}",
                target.name
            );
            println!(
                "{} {seed}.{kind}: {uploads} uploads -> 1 ingestion, {chunks} chunks, {} texts embedded in {} calls",
                target.name,
                embedder.texts() - texts,
                embedder.calls() - calls
            );
        }
        let counted = ingestor.reconcile().await.unwrap();
        assert_eq!(counted.unpublished, 0, "{}: {counted:?}", target.name);
        assert_eq!(counted.count_mismatches, 0, "{}: {counted:?}", target.name);
        assert_eq!(
            counted.superseded_in_grace + counted.superseded_past_grace,
            0
        );
        // One ingestion per file in the tenant's list, each indexed whole.
        let listed = ingestor.ingestions("acme").await.unwrap();
        assert_eq!(listed.len(), 2, "{}: {listed:?}", target.name);
        for one in &listed {
            assert_eq!(one.state, agentgate_ingest::IngestionState::Indexed);
            assert_eq!(one.chunks_stored, one.chunks, "{one:?}");
        }
        let hits = ingestor
            .search("acme", "harbour cafe lunch receipt 7", 3)
            .await
            .unwrap();
        assert_eq!(hits.len(), 3, "{}", target.name);
        let ids: HashSet<_> = hits
            .iter()
            .map(|h| (&h.document_id, h.chunk_index))
            .collect();
        assert_eq!(ids.len(), hits.len(), "{}: no passage twice", target.name);
        // The PDF's text came through its parser: a sentence of it is found.
        let from_pdf = ingestor
            .search("acme", "triple receipt 7: lunch with the team", 5)
            .await
            .unwrap();
        assert!(
            from_pdf
                .iter()
                .any(|h| h.name == "triple.pdf" && h.text.contains("paid by card, total 3")),
            "{}: {from_pdf:?}",
            target.name
        );
    }
}

/// The holder binary, SIGKILLed once `stored_chunks` chunks of its
/// document are in the index.
async fn kill_holder_after(
    target: &Target,
    tenant: &str,
    file: &std::path::Path,
    calls: &std::path::Path,
    stored: i64,
) {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_agentgate-ingest-holder"))
        .args([
            target.store_url.as_str(),
            target.redis_url.as_deref().unwrap_or("-"),
            "1000",
            "150",
            tenant,
            file.to_str().unwrap(),
            calls.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let (watcher, _) = ingestor(target, Config::default()).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let counted = watcher.reconcile().await.unwrap();
        if counted.unpublished >= stored {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{}: the holder stored {} chunks in a minute",
            target.name,
            counted.unpublished
        );
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "{}: the holder ended before the kill: {status}",
                target.name
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    child.kill().await.unwrap();
}

/// A holder SIGKILLed after k of n batches, for several k: recovery takes
/// the orphan over and finishes it, embedding only the batches not stored
/// (the one the holder left unknown included), so the embedder is paid at
/// most n + (unknown batches) times in all, counted in both processes, and
/// the index holds each chunk once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_killed_mid_ingestion_is_finished_paying_only_for_missing_batches() {
    for target in all_targets().await {
        for k in [1, 3] {
            let dir = tempfile::tempdir().unwrap();
            let file = dir.path().join(format!("crash-{k}.txt"));
            let content = document(&format!("crash {k}"), 600);
            std::fs::write(&file, &content).unwrap();
            let tenant = format!("crash-{k}");
            let calls = dir.path().join("holder-calls.log");
            kill_holder_after(&target, &tenant, &file, &calls, (k * EMBED_BATCH) as i64).await;
            // What the killed holder paid for, from its own log, and what the
            // index held when it died, from the rows.
            let logged = std::fs::read_to_string(&calls).unwrap();
            let holder_calls = logged.lines().count() as u64;
            let holder_texts: u64 = logged.lines().map(|l| l.parse::<u64>().unwrap()).sum();
            let (watcher, _) = ingestor(&target, Config::default()).await;
            let stored_at_kill = watcher.reconcile().await.unwrap().unpublished as u64;
            let (ingestor, embedder) = ingestor(&target, Config::default()).await;
            // The holder's lease (1 s) expires; then its turn is an orphan.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            let recovered = loop {
                let found = ingestor.recover().await.unwrap();
                if let Some(one) = found.into_iter().next() {
                    break one;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{}: no orphan to recover in 30 s",
                    target.name
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            let chunks = u64::try_from(recovered.ingested.chunks).unwrap();
            let n = chunks.div_ceil(EMBED_BATCH as u64);
            let stored = recovered.batches_stored_before as u64;
            let unknown = recovered.batches_unknown as u64;
            assert!(stored >= k as u64, "{}: {recovered:?}", target.name);
            assert!(unknown <= 1, "one batch at a time: {recovered:?}");
            assert_eq!(embedder.calls(), n - stored, "{}: k={k}", target.name);
            // The killed holder paid for each batch it stored, and perhaps for
            // the one it left unknown (it may die between the claim and the
            // call): in all at most n + unknown calls, at least n.
            assert!(
                (stored..=stored + unknown).contains(&holder_calls),
                "{}: k={k}: the holder made {holder_calls} calls",
                target.name
            );
            let total = holder_calls + embedder.calls();
            // Measured apart from the journal: recovery embedded exactly the
            // chunks the index did not hold when the holder died, and the
            // holder paid for those it stored plus at most one batch more.
            assert_eq!(
                embedder.texts(),
                chunks - stored_at_kill,
                "{}: k={k}",
                target.name
            );
            assert!(
                (stored_at_kill..=stored_at_kill + EMBED_BATCH as u64).contains(&holder_texts),
                "{}: k={k}: the holder embedded {holder_texts} texts, {stored_at_kill} stored",
                target.name
            );
            assert!(holder_texts + embedder.texts() <= chunks + EMBED_BATCH as u64);
            let counted = ingestor.reconcile().await.unwrap();
            assert_eq!(counted.unpublished, 0, "{}: {counted:?}", target.name);
            assert_eq!(counted.count_mismatches, 0, "{}: {counted:?}", target.name);
            let document = ingestor
                .document(&recovered.ingested.document_id)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(
                document.chunks, recovered.ingested.chunks,
                "{}",
                target.name
            );
            let again = ingestor
                .ingest(&upload(&tenant, "crash.txt", &content))
                .await
                .unwrap();
            assert_eq!(again, recovered.ingested, "a later upload replays it");
            assert_eq!(turns_of(&target, &again.document_id).await, 1);
            println!(
                "{} k={k}: n={n} batches, {stored} stored before the kill, {unknown} unknown; \
                 the holder made {holder_calls} embedding calls, recovery {}, {total} in all",
                target.name,
                embedder.calls()
            );
        }
    }
}

/// 50 updates of one document, from two updaters at once, under 20
/// readers that search it without pause: every read sees all of one
/// version (never nothing, never two versions mixed, never a version with
/// a chunk missing), and the document ends with one current version, the
/// last one published. Uploading the first version again then makes it
/// current again (a revert is not a replay).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn updates_under_load_never_show_a_gap_or_a_mix() {
    for target in all_targets().await {
        let (ingestor, _) = ingestor(&target, Config::default()).await;
        let first_content = document("version 0", 20);
        let first = ingestor
            .ingest(&upload("upd", "policy.md", &first_content))
            .await
            .unwrap();
        // Every version's chunk count, by its content hash.
        let mut sizes = std::collections::HashMap::new();
        sizes.insert(first.version.clone(), first.chunks);
        for u in 0..2 {
            for i in 0..25 {
                let content = document(&format!("v{u}.{i}"), 20 + i);
                let text = agentgate_ingest::chunk::parse(&content, MediaType::Markdown).unwrap();
                let n = agentgate_ingest::chunk::chunks(&text).unwrap().len() as i64;
                sizes.insert(agentgate_ingest::chunk::sha256_hex(&content), n);
            }
        }
        let sizes = Arc::new(sizes);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..20)
            .map(|_| {
                let (ingestor, stop, sizes) = (ingestor.clone(), stop.clone(), sizes.clone());
                tokio::spawn(async move {
                    let mut reads = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                        let hits = ingestor
                            .search("upd", "policy section refundable", 50)
                            .await
                            .unwrap();
                        assert!(!hits.is_empty(), "a read saw no version");
                        let versions: HashSet<_> = hits.iter().map(|h| h.version.clone()).collect();
                        assert_eq!(versions.len(), 1, "a read mixed versions: {versions:?}");
                        let version = versions.into_iter().next().unwrap();
                        assert_eq!(hits.len() as i64, sizes[&version], "a read saw a gap");
                        reads += 1;
                    }
                    reads
                })
            })
            .collect();
        let updaters: Vec<_> = (0..2)
            .map(|u| {
                let (ingestor, id) = (ingestor.clone(), first.document_id.clone());
                tokio::spawn(async move {
                    let mut last = Vec::new();
                    for i in 0..25 {
                        let mut update =
                            upload("upd", "policy.md", &document(&format!("v{u}.{i}"), 20 + i));
                        update.document_id = Some(id.clone());
                        last.push(ingestor.ingest(&update).await.unwrap());
                    }
                    last
                })
            })
            .collect();
        let mut published = Vec::new();
        for updater in updaters {
            published.extend(updater.await.unwrap());
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut reads = 0;
        for reader in readers {
            reads += reader.await.unwrap();
        }
        let numbers: HashSet<_> = published.iter().map(|p| p.version_no).collect();
        assert_eq!(
            numbers.len(),
            50,
            "{}: every update its own number",
            target.name
        );
        let last = published.iter().max_by_key(|p| p.version_no).unwrap();
        let document = ingestor
            .document(&first.document_id)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(document.current_version, last.version, "{}", target.name);
        assert_eq!(document.version_no, 51, "{}", target.name);
        let counted = ingestor.reconcile().await.unwrap();
        assert_eq!(counted.current_chunks, document.chunks, "{}", target.name);
        assert_eq!(counted.count_mismatches, 0, "{}", target.name);
        let mut revert = upload("upd", "policy.md", &first_content);
        revert.document_id = Some(first.document_id.clone());
        let reverted = ingestor.ingest(&revert).await.unwrap();
        assert_eq!(reverted.version, first.version);
        assert_eq!(
            reverted.version_no, 52,
            "{}: a revert publishes",
            target.name
        );
        let document = ingestor
            .document(&first.document_id)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(document.current_version, first.version, "{}", target.name);
        // Past the switch's millisecond, so every superseded version is due.
        tokio::time::sleep(Duration::from_millis(5)).await;
        let deleted = ingestor.clean(Duration::ZERO).await.unwrap();
        let after = ingestor.reconcile().await.unwrap();
        assert_eq!(
            after.superseded_past_grace + after.superseded_in_grace,
            0,
            "{after:?}"
        );
        assert_eq!(after.current_chunks, document.chunks);
        // Deleted: nothing of it is found, its chunks are gone, and the same
        // file uploaded again is a new ingestion, not a replay of the old one.
        let gone = ingestor.delete("upd", &first.document_id).await.unwrap();
        assert_eq!(
            gone,
            u64::try_from(document.chunks).unwrap(),
            "{}",
            target.name
        );
        let hits = ingestor
            .search("upd", "policy section refundable", 50)
            .await
            .unwrap();
        assert!(hits.is_empty(), "{}: {hits:?}", target.name);
        assert_eq!(ingestor.reconcile().await.unwrap().current_chunks, 0);
        assert_eq!(ingestor.delete("upd", &first.document_id).await.unwrap(), 0);
        let listed = ingestor.ingestions("upd").await.unwrap();
        assert!(
            listed
                .iter()
                .all(|i| i.state == agentgate_ingest::IngestionState::Deleted
                    || i.state == agentgate_ingest::IngestionState::Superseded),
            "{listed:?}"
        );
        let again = ingestor.ingest(&revert).await.unwrap();
        assert_eq!(
            again.version_no, 53,
            "{}: a new ingestion after the delete",
            target.name
        );
        assert_eq!(
            ingestor.reconcile().await.unwrap().current_chunks,
            again.chunks
        );
        // The list and the dashboard's view show it: indexed, version 53.
        let newest = ingestor.ingestions("upd").await.unwrap().remove(0);
        assert_eq!(newest.state, agentgate_ingest::IngestionState::Indexed);
        assert_eq!(newest.version_no, Some(53), "{}: {newest:?}", target.name);
        assert_eq!(newest.tenant, "upd");
        let recent = ingestor.recent(500).await.unwrap();
        assert!(recent.len() <= 50, "bounded by MAX_LISTED_INGESTIONS");
        assert_eq!(recent[0].turn_id, newest.turn_id, "{}", target.name);
        let denied = ingestor.delete("someone-else", &first.document_id).await;
        assert!(
            matches!(denied, Err(agentgate_ingest::IngestError::Invalid(_))),
            "{denied:?}"
        );
        println!(
            "{}: 50 updates under {reads} reads, 0 empty, 0 mixed; cleaner deleted {deleted} old chunks",
            target.name
        );
    }
}
