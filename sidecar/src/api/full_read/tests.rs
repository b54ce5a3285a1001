use super::*;
use crate::metrics::Metrics;
use http_body_util::BodyExt;
use std::sync::atomic::AtomicUsize;

fn full_reads(max_full_reads: u32, reuse_ms: u64) -> (FullReads, Metrics) {
    full_reads_with(max_full_reads, reuse_ms, max_full_reads)
}

fn full_reads_with(max_full_reads: u32, reuse_ms: u64, copies: u32) -> (FullReads, Metrics) {
    let metrics = Metrics::new().unwrap();
    let server = Server {
        max_full_reads,
        max_full_read_copies: copies,
        full_read_reuse: Duration::from_millis(reuse_ms),
        ..Server::default()
    };
    (FullReads::new(&server, &metrics.listener), metrics)
}

/// A copy for a reader of `what` (with the token or not), as the routes
/// get one.
async fn read<E, F>(
    reads: &FullReads,
    what: Whole,
    holds_token: bool,
    build: impl FnOnce() -> F,
) -> Result<Bytes, E>
where
    F: Future<Output = Result<Bytes, E>>,
{
    let place = reads.admit(what, holds_token).expect("a place");
    reads.copy(&place, build).await
}

fn alive(metrics: &Metrics, what: &str) -> i64 {
    metrics
        .listener
        .full_read_copies_alive
        .with_label_values(&[what])
        .get()
}

/// A build that counts itself and makes a new allocation each time.
async fn build(builds: &AtomicUsize) -> Result<Bytes, ()> {
    builds.fetch_add(1, Ordering::SeqCst);
    tokio::task::yield_now().await;
    Ok(Bytes::from(vec![7u8; 3 * CHUNK + 5]))
}

#[tokio::test]
async fn readers_share_one_copy_while_it_is_young() {
    let (reads, metrics) = full_reads(8, 60_000);
    let reads = Arc::new(reads);
    let builds = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (reads, builds) = (reads.clone(), builds.clone());
            tokio::spawn(async move { read(&reads, Whole::Dump, false, || build(&builds)).await })
        })
        .collect();
    let mut copies = Vec::new();
    for t in tasks {
        copies.push(t.await.unwrap().unwrap());
    }
    assert_eq!(builds.load(Ordering::SeqCst), 1, "one encode for all");
    assert!(
        copies.iter().all(|c| c.as_ptr() == copies[0].as_ptr()),
        "every reader holds the same allocation"
    );
    assert_eq!(
        metrics
            .listener
            .full_read_copies
            .with_label_values(&["dump"])
            .get(),
        1
    );
    // The other kind is its own copy.
    read(&reads, Whole::SnapshotReset, false, || build(&builds))
        .await
        .unwrap();
    assert_eq!(builds.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_copy_is_not_reused_past_its_age_nor_kept() {
    let (reads, _m) = full_reads_with(8, 0, 8);
    let builds = AtomicUsize::new(0);
    let a = read(&reads, Whole::Dump, false, || build(&builds))
        .await
        .unwrap();
    let b = read(&reads, Whole::Dump, false, || build(&builds))
        .await
        .unwrap();
    assert_eq!(
        builds.load(Ordering::SeqCst),
        2,
        "reuse 0: each read encodes"
    );
    assert_ne!(a.as_ptr(), b.as_ptr());
    assert!(latest_is_none(&reads).await);

    let (reads, _m) = full_reads(8, 20);
    read(&reads, Whole::Dump, false, || build(&builds))
        .await
        .unwrap();
    // The cache lets go of the copy once it is too old to serve.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !latest_is_none(&reads).await {
        assert!(std::time::Instant::now() < deadline, "the copy was kept");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    read(&reads, Whole::Dump, false, || build(&builds))
        .await
        .unwrap();
    assert_eq!(builds.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn a_failed_build_is_not_kept() {
    let (reads, _m) = full_reads(8, 60_000);
    let r: Result<Bytes, &str> =
        read(&reads, Whole::Dump, false, || async { Err("recovering") }).await;
    assert_eq!(r, Err("recovering"));
    let builds = AtomicUsize::new(0);
    read(&reads, Whole::Dump, false, || build(&builds))
        .await
        .unwrap();
    assert_eq!(builds.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn readers_over_the_cap_are_refused_until_one_is_done() {
    let (reads, metrics) = full_reads(2, 60_000);
    let bytes = Bytes::from(vec![1u8; 10]);
    let open = || {
        metrics
            .listener
            .full_reads_open
            .with_label_values(&["dump"])
            .get()
    };
    // Two answers nobody reads yet: their places are held.
    let first = reads.respond(reads.admit(Whole::Dump, false).unwrap(), bytes.clone());
    let second = reads.respond(
        reads.admit(Whole::SnapshotReset, false).unwrap(),
        bytes.clone(),
    );
    assert_eq!(open(), 1);
    let busy = reads.admit(Whole::Dump, false).err().expect("over the cap");
    let r = busy.into_response();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.headers()[RETRY_AFTER], "1");
    assert_eq!(
        metrics
            .listener
            .full_reads_refused
            .with_label_values(&["dump"])
            .get(),
        1
    );
    // Readers with the token have places of their own, as many.
    let trusted = [
        reads.admit(Whole::Dump, true).unwrap(),
        reads.admit(Whole::SnapshotReset, true).unwrap(),
    ];
    assert!(reads.admit(Whole::Dump, true).is_err());
    assert_eq!(
        metrics
            .listener
            .full_reads_refused
            .with_label_values(&["dump"])
            .get(),
        2
    );
    drop(trusted);
    // A reader that finishes gives its place back.
    let body = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, bytes);
    assert_eq!(open(), 0);
    let third = reads.admit(Whole::Dump, false);
    assert!(third.is_ok());
    drop((second, third));
    assert!(reads.admit(Whole::Dump, false).is_ok());
}

#[tokio::test]
async fn a_body_is_slices_of_the_shared_copy_with_its_length() {
    let (reads, _m) = full_reads(2, 60_000);
    let bytes = Bytes::from((0..3 * CHUNK + 5).map(|i| i as u8).collect::<Vec<_>>());
    let r = reads.respond(reads.admit(Whole::Dump, true).unwrap(), bytes.clone());
    let mut body = r.into_body();
    assert_eq!(body.size_hint().exact(), Some(bytes.len() as u64));
    let mut at = 0;
    while let Some(frame) = body.frame().await {
        let data = frame.unwrap().into_data().unwrap();
        assert!(data.len() <= CHUNK);
        // A slice of the copy, not a copy of it.
        assert_eq!(data.as_ptr(), bytes[at..].as_ptr());
        at += data.len();
    }
    assert_eq!(at, bytes.len());
}

async fn latest_is_none(reads: &FullReads) -> bool {
    reads.slot(Whole::Dump).classes[0]
        .lock()
        .await
        .latest
        .is_none()
}

#[tokio::test]
async fn past_the_copies_cap_a_reader_gets_the_newest_copy_alive_however_old() {
    // No reuse by age: only the cap makes readers share.
    let (reads, metrics) = full_reads_with(8, 0, 2);
    let builds = AtomicUsize::new(0);
    let a = read(&reads, Whole::Dump, false, || build(&builds))
        .await
        .unwrap();
    let b = read(&reads, Whole::Dump, false, || build(&builds))
        .await
        .unwrap();
    assert_eq!(alive(&metrics, "dump"), 2);
    // Readers spaced out, each still reading: the newest copy, not a third.
    for _ in 0..4 {
        let c = read(&reads, Whole::Dump, false, || build(&builds))
            .await
            .unwrap();
        assert_eq!(c.as_ptr(), b.as_ptr());
    }
    assert_eq!(builds.load(Ordering::SeqCst), 2);
    assert_eq!(alive(&metrics, "dump"), 2);
    // Readers with the token have copies of their own: a slow reader
    // without it cannot keep them on an old copy.
    let t = read(&reads, Whole::Dump, true, || build(&builds))
        .await
        .unwrap();
    assert_ne!(t.as_ptr(), b.as_ptr());
    assert_eq!(alive(&metrics, "dump"), 3);
    // Once a reader lets go, a new copy is made again.
    drop(a);
    let d = read(&reads, Whole::Dump, false, || build(&builds))
        .await
        .unwrap();
    assert_ne!(d.as_ptr(), b.as_ptr());
    assert_eq!(builds.load(Ordering::SeqCst), 4);
    drop((b, d, t));
    assert_eq!(alive(&metrics, "dump"), 0, "every copy is gone");
}
