use super::*;
use crate::metrics::Metrics;
use http_body_util::BodyExt;
use std::sync::atomic::AtomicUsize;

fn full_reads(max_full_reads: u32, reuse_ms: u64) -> (FullReads, Metrics) {
    let metrics = Metrics::new().unwrap();
    let server = Server {
        max_full_reads,
        full_read_reuse: Duration::from_millis(reuse_ms),
        ..Server::default()
    };
    (FullReads::new(&server, &metrics.listener), metrics)
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
            tokio::spawn(async move { reads.copy(Whole::Dump, || build(&builds)).await })
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
    reads
        .copy(Whole::SnapshotReset, || build(&builds))
        .await
        .unwrap();
    assert_eq!(builds.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_copy_is_not_reused_past_its_age_nor_kept() {
    let (reads, _m) = full_reads(8, 0);
    let builds = AtomicUsize::new(0);
    let a = reads.copy(Whole::Dump, || build(&builds)).await.unwrap();
    let b = reads.copy(Whole::Dump, || build(&builds)).await.unwrap();
    assert_eq!(
        builds.load(Ordering::SeqCst),
        2,
        "reuse 0: each read encodes"
    );
    assert_ne!(a.as_ptr(), b.as_ptr());
    assert!(reads.slot(Whole::Dump).latest.lock().await.is_none());

    let (reads, _m) = full_reads(8, 20);
    reads.copy(Whole::Dump, || build(&builds)).await.unwrap();
    // The cache lets go of the copy once it is too old to serve.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while reads.slot(Whole::Dump).latest.lock().await.is_some() {
        assert!(std::time::Instant::now() < deadline, "the copy was kept");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    reads.copy(Whole::Dump, || build(&builds)).await.unwrap();
    assert_eq!(builds.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn a_failed_build_is_not_kept() {
    let (reads, _m) = full_reads(8, 60_000);
    let r: Result<Bytes, &str> = reads
        .copy(Whole::Dump, || async { Err("recovering") })
        .await;
    assert_eq!(r, Err("recovering"));
    let builds = AtomicUsize::new(0);
    reads.copy(Whole::Dump, || build(&builds)).await.unwrap();
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
    let first = reads.respond(
        Whole::Dump,
        reads.admit(Whole::Dump, false).unwrap(),
        bytes.clone(),
    );
    let second = reads.respond(
        Whole::SnapshotReset,
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
    let r = reads.respond(
        Whole::Dump,
        reads.admit(Whole::Dump, true).unwrap(),
        bytes.clone(),
    );
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
