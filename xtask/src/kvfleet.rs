//! What the KV and hostile benchmarks stand on alike: a stack whose
//! workers' KV events the benchmark publishes itself (vLLM's wire format
//! over ZMQ, chains of 2048 tokens), so that an index of any size is
//! built in seconds, and the wait until the sidecar holds it.

use anyhow::{Context, Result, bail};
use kvgate_sim::cache::{CacheEvent, Scope};
use kvgate_sim::wire::{EventShape, HashMode, SimEvent, encode_batch};
use kvgate_stack::{Stack, StackConfig};
use std::time::{Duration, Instant};

/// Blocks per published chain.
pub const CHAIN_BLOCKS: usize = 128;

/// The stack both benchmarks start: `workers` instant simulated workers
/// whose events come from this process, the selection API on, and
/// scrapes quick enough that the sidecar sees the fleet within a second.
pub fn config(workers: usize) -> StackConfig {
    StackConfig {
        workers,
        kv_events: true,
        kv_external: true,
        sim_args: ["--instant", "--default-max-tokens", "1"]
            .map(String::from)
            .to_vec(),
        selection_api: true,
        scrape_interval_ms: 250,
        down_after_ms: 3000,
        ..StackConfig::default()
    }
}

/// The tokens of `worker`'s `chain`th chain: every chain distinct.
pub fn chain_tokens(worker: usize, chain: usize) -> Vec<u32> {
    let base = (worker as u32) * 1_000_003 + (chain as u32) * 4099;
    (0..(CHAIN_BLOCKS * 16) as u32)
        .map(|i| (base.wrapping_add(i * 7919)) % 1_000_000 + 100)
        .collect()
}

/// A publisher per worker of `stack`, in order, each on the worker's
/// event port, once the sidecar's subscribers have found them.
pub fn publishers(stack: &Stack) -> Result<Vec<Publisher>> {
    let ctx = zmq::Context::new();
    let mut pubs = Vec::new();
    for w in &stack.workers {
        let port = w.events_port.context("no event port")?;
        pubs.push(Publisher::bind(&ctx, port, w.id << 40)?);
    }
    // Subscribers reconnect every 100 ms; let them find the new sockets.
    std::thread::sleep(Duration::from_millis(1500));
    Ok(pubs)
}

/// Publishes `chains` chains on each publisher (worker `w`'s from
/// [`chain_tokens`]`(w, ..)`) and waits until the sidecar has indexed
/// them; the blocks published.
pub fn fill(stack: &Stack, pubs: &mut [Publisher], chains: usize) -> Result<usize> {
    let mut published = 0;
    for (w, p) in pubs.iter_mut().enumerate() {
        let c: Vec<Vec<u32>> = (0..chains).map(|c| chain_tokens(w, c)).collect();
        published += p.chains(&c)?;
    }
    let deadline = Instant::now() + Duration::from_secs(180);
    while indexed(stack) < published as f64 * 0.999 {
        if Instant::now() > deadline {
            bail!("index reached {} of {published} blocks", indexed(stack));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(published)
}

/// Blocks the sidecar has indexed for the demo model.
fn indexed(stack: &Stack) -> f64 {
    stack
        .sidecar_metric("kvgate_sidecar_kv_indexed_blocks{model=\"demo-model\"}")
        .unwrap_or(0.0)
}

/// A worker's KV event publisher, played by the benchmark.
pub struct Publisher {
    sock: zmq::Socket,
    seq: u64,
    next_hash: u64,
}

impl Publisher {
    /// Binds the worker's event port; block hashes count up from
    /// `first_hash`, so workers given far-apart starts never collide.
    pub fn bind(ctx: &zmq::Context, port: u16, first_hash: u64) -> Result<Publisher> {
        let sock = ctx.socket(zmq::PUB)?;
        sock.set_sndhwm(1_000_000)?;
        sock.bind(&format!("tcp://127.0.0.1:{port}"))?;
        Ok(Publisher {
            sock,
            seq: 0,
            next_hash: first_hash,
        })
    }

    /// Leaves out the next `n` sequence numbers: a gap the subscriber
    /// sees and asks the replay endpoint to fill.
    pub fn skip(&mut self, n: u64) {
        self.seq += n;
    }

    /// Publishes whole chains: one event per 16 blocks, 64 events a batch.
    pub fn chains(&mut self, chains: &[Vec<u32>]) -> Result<usize> {
        let mut events = Vec::new();
        let mut blocks = 0;
        for tokens in chains {
            let mut parent = None;
            for part in tokens.chunks(16 * 16) {
                let hashes: Vec<u64> = (0..part.len() / 16)
                    .map(|_| {
                        self.next_hash += 1;
                        self.next_hash
                    })
                    .collect();
                blocks += hashes.len();
                let last = hashes.last().copied();
                events.push(SimEvent::Cache(CacheEvent::Stored {
                    hashes,
                    parent,
                    tokens: part.to_vec(),
                    scope: Scope::default(),
                }));
                parent = last;
                if events.len() == 64 {
                    self.send(&events)?;
                    events.clear();
                }
            }
        }
        if !events.is_empty() {
            self.send(&events)?;
        }
        Ok(blocks)
    }

    fn send(&mut self, events: &[SimEvent]) -> Result<()> {
        let payload = encode_batch(1.0, events, 0, 16, EventShape::Tagged, HashMode::U64);
        self.sock
            .send_multipart([&b""[..], &self.seq.to_be_bytes()[..], &payload[..]], 0)?;
        self.seq += 1;
        Ok(())
    }
}
