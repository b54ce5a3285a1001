//! Starts and stops a local kvgate stack: real Envoy with the kvgate filter,
//! the sidecar, and `kvgate-sim` workers, all on loopback.
//!
//! One implementation serves `cargo xtask demo`, the end-to-end tests and the
//! benchmarks, so what the tests check is exactly what the demo shows. Every
//! process is killed when the [`Stack`] is dropped, and each one writes its
//! output to a log file whose tail is printed when start-up fails.

mod envoy;
pub mod http;
mod jwt;
mod paths;
mod ports;
mod process;

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use paths::Paths;
pub use ports::{free_block, free_ports};
pub use process::{Proc, tails};

/// What to start.
#[derive(Debug, Clone)]
pub struct StackConfig {
    pub model: String,
    pub workers: usize,
    pub dp_size: u32,
    pub block_size: u32,
    /// The block (page) size workers cache and publish at, when it is not
    /// the catalog's `block_size` (SGLang's default page size is 1).
    pub engine_block_size: Option<u32>,
    /// Extra `kvgate-sim` flags for every worker (time model, cache size...).
    pub sim_args: Vec<String>,
    /// Extra `kvgate-sim` flags for worker `i` only, after `sim_args`: a
    /// mixed fleet, e.g. `--metrics-flavor sglang` for some workers.
    pub worker_sim_args: Vec<Vec<String>>,
    /// Whether workers publish KV events over ZMQ (ports are allocated).
    pub kv_events: bool,
    /// With `kv_events`: the sidecar subscribes to the allocated ports but
    /// the workers do not publish there; the caller binds its own
    /// publishers (benchmarks feeding synthetic events). No replay.
    pub kv_external: bool,
    /// With `kv_external`: each worker's replay endpoint is configured
    /// too, and the caller binds the ROUTERs behind them.
    pub kv_external_replay: bool,
    /// Plugin configuration merged over the stack's defaults.
    pub plugin: serde_json::Value,
    /// Extra TOML appended to the `[[models]]` entry (thresholds).
    pub model_toml: String,
    /// Sidecar scrape interval.
    pub scrape_interval_ms: u64,
    pub down_after_ms: u64,
    pub envoy_concurrency: u32,
    /// The bearer token the control API requires, if any.
    pub control_token: Option<String>,
    /// Tenant of worker `i` (`default` where absent).
    pub tenants: Vec<String>,
    /// Catalog role of worker `i` (`both` where absent): `prefill` or
    /// `decode` for a disaggregated model (see `model_toml`).
    pub roles: Vec<String>,
    /// Each `prefill` worker gets an SGLang bootstrap port of its own,
    /// allocated here (not the sim's `--bootstrap-port 0`, whose choice
    /// the catalog could not know), passed to the sim and written to the
    /// catalog's `bootstrap_port`.
    pub bootstrap_ports: bool,
    /// Gateway pods (an Envoy and its sidecar each) in front of the same
    /// workers.
    pub gateways: usize,
    /// The sidecars share their load over replica sync (each subscribes to
    /// every other).
    pub replica_sync: bool,
    /// Each sidecar serves the selection API on a port of its own.
    pub selection_api: bool,
    /// Workers' simulated GPUs are named in the catalog and read from their
    /// dcgm-exporter pages.
    pub thermal: Option<ThermalStack>,
    /// Envoy loads the filter as an HTTP filter only, with no bootstrap
    /// snapshot service (`"poller": "lease"`), as Envoy Gateway and Istio
    /// do. Defaults to whether `KVGATE_HTTP_FILTER_ONLY` is set, so that a
    /// test binary's suite can run again in that mode unchanged.
    pub http_filter_only: bool,
    /// The routes kvgate is compared with, on Envoy listeners of their own
    /// ([`Stack::least_request_url`], [`Stack::extproc_url`]): Envoy's
    /// least-request balancing over the workers, and kvgate's decision
    /// outside the proxy through `ext_proc` (`kvgate-extproc`, from the bin
    /// directory, running its own sidecar in-process with this stack's
    /// sidecar configuration), the architecture peers use.
    pub extproc: bool,
    /// Another build of the filter module, run by a second kvgate listener
    /// of the same Envoy ([`Stack::baseline_url`]): before and after
    /// measured side by side, on the same workers and the same shared
    /// data (its VMs read the snapshot service's, under the same vm_id, so
    /// the two builds must agree on its format).
    pub baseline_wasm: Option<PathBuf>,
}

impl StackConfig {
    /// Workers tokenize text with a model's own files (`tokenizer.json`,
    /// `tokenizer_config.json`); with `text_index` the sidecar reads them
    /// too (`[models.prompt]`) and matches chat and text prompts against
    /// the workers' events. Call after setting `sim_args` and `model_toml`.
    pub fn with_prompt_files(
        mut self,
        tokenizer: &Path,
        tokenizer_config: &Path,
        text_index: bool,
    ) -> StackConfig {
        let (t, c) = (
            tokenizer.display().to_string(),
            tokenizer_config.display().to_string(),
        );
        self.sim_args.extend([
            "--tokenizer".into(),
            t.clone(),
            "--tokenizer-config".into(),
            c.clone(),
        ]);
        if text_index {
            self.model_toml.push_str(&format!(
                "\n[models.prompt]\ntokenizer = {t:?}\ntokenizer_config = {c:?}\n"
            ));
        }
        self
    }
}

/// The thermal side of a stack.
#[derive(Debug, Clone, Default)]
pub struct ThermalStack {
    /// GPUs per worker (its tensor-parallel group, `kvgate-sim --gpus`).
    pub gpus: u32,
    /// Workers are registered with `batch_control = true`.
    pub batch_control: bool,
    /// Keys appended to the sidecar's `[thermal]` table.
    pub toml: String,
}

impl Worker {
    /// The UUIDs `kvgate-sim` gives this worker's GPUs.
    pub fn gpu_uuids(&self, gpus: u32) -> Vec<String> {
        (0..gpus)
            .map(|i| format!("GPU-sim-{}-{i}", self.port))
            .collect()
    }
}

impl Default for StackConfig {
    fn default() -> Self {
        StackConfig {
            model: "demo-model".into(),
            workers: 4,
            dp_size: 1,
            block_size: 16,
            engine_block_size: None,
            sim_args: vec!["--speedup".into(), "20".into()],
            worker_sim_args: Vec::new(),
            kv_events: false,
            kv_external: false,
            kv_external_replay: false,
            plugin: serde_json::json!({}),
            model_toml: String::new(),
            scrape_interval_ms: 100,
            down_after_ms: 600,
            envoy_concurrency: 2,
            control_token: None,
            tenants: Vec::new(),
            roles: Vec::new(),
            bootstrap_ports: false,
            gateways: 1,
            replica_sync: false,
            selection_api: false,
            thermal: None,
            http_filter_only: std::env::var_os("KVGATE_HTTP_FILTER_ONLY").is_some(),
            extproc: false,
            baseline_wasm: None,
        }
    }
}

/// One simulated worker and the ports it serves.
#[derive(Debug)]
pub struct Worker {
    pub id: u64,
    pub port: u16,
    pub events_port: Option<u16>,
    pub replay_port: Option<u16>,
    /// Its SGLang bootstrap server's port ([`StackConfig::bootstrap_ports`]).
    pub bootstrap_port: Option<u16>,
    args: Vec<String>,
    proc: Option<Proc>,
}

impl Worker {
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

/// One gateway pod: an Envoy with the filter, and the sidecar beside it.
#[derive(Debug)]
pub struct Gateway {
    pub envoy_port: u16,
    pub plain_port: u16,
    pub admin_port: u16,
    pub sidecar_port: u16,
    pub control_port: u16,
    /// The sidecar's selection API, when the stack serves it.
    pub selection_port: u16,
    /// The sidecar's replica-sync PUB socket, when the stack syncs.
    pub sync_port: u16,
    /// With [`StackConfig::extproc`]: Envoy's least-request listener, its
    /// ext_proc listener, `kvgate-extproc`'s gRPC listener and its
    /// in-process sidecar's HTTP API.
    pub least_request_port: u16,
    pub extproc_port: u16,
    pub extproc_grpc_port: u16,
    pub extproc_sidecar_port: u16,
    /// With [`StackConfig::baseline_wasm`]: the listener running it.
    pub baseline_port: u16,
    /// Names its config and logs apart from the other gateways' ("" for
    /// the first).
    tag: String,
    envoy: Option<Proc>,
    sidecar: Option<Proc>,
    extproc: Option<Proc>,
}

/// A running stack. Dropping it stops every process.
pub struct Stack {
    pub paths: Paths,
    pub config: StackConfig,
    /// The first is the one [`Stack::envoy_url`] and the other unqualified
    /// accessors mean.
    pub gateways: Vec<Gateway>,
    pub workers: Vec<Worker>,
    pub run_dir: PathBuf,
    /// Signs the JWTs whose `tenant` claim Envoy turns into the tenant
    /// header; made afresh for every stack.
    tenant_key: Vec<u8>,
}

impl Stack {
    /// Starts everything and waits until Envoy routes with fresh state.
    pub fn start(config: StackConfig) -> Result<Stack> {
        Stack::start_with(Paths::discover()?, config)
    }

    /// Like [`Stack::start`] with explicit locations of the parts.
    pub fn start_with(paths: Paths, config: StackConfig) -> Result<Stack> {
        paths.check()?;
        if config.extproc && config.replica_sync {
            // Its in-process sidecar would bind the sidecar's sync port.
            bail!("the ext_proc comparison route does not run with replica sync");
        }
        if config.extproc && !paths.bin("kvgate-extproc").exists() {
            bail!(
                "missing {}: build it with `cargo build -p kvgate-extproc`",
                paths.bin("kvgate-extproc").display()
            );
        }
        let run_dir = paths.new_run_dir()?;
        let n_gateways = config.gateways.max(1);
        let mut ports = ports::free_ports(12 * n_gateways + 2 * config.workers)?.into_iter();
        let mut next = || ports.next().context("ran out of allocated ports");
        let mut gateways = Vec::with_capacity(n_gateways);
        for g in 0..n_gateways {
            gateways.push(Gateway {
                envoy_port: next()?,
                plain_port: next()?,
                admin_port: next()?,
                sidecar_port: next()?,
                control_port: next()?,
                selection_port: next()?,
                sync_port: next()?,
                least_request_port: next()?,
                extproc_port: next()?,
                extproc_grpc_port: next()?,
                extproc_sidecar_port: next()?,
                baseline_port: next()?,
                tag: if g == 0 {
                    String::new()
                } else {
                    format!("-{}", g + 1)
                },
                envoy: None,
                sidecar: None,
                extproc: None,
            });
        }

        // Engines put DP rank r on base + r, so event ports come from one
        // contiguous run: [events(dp), replay(dp)] per worker.
        let dp = config.dp_size as u16;
        let event_base = if config.kv_events {
            Some(ports::free_block(2 * dp * config.workers as u16)?)
        } else {
            None
        };
        let mut workers = Vec::with_capacity(config.workers);
        for i in 0..config.workers {
            let id = i as u64 + 1;
            let port = next()?;
            let (events_port, replay_port) = match event_base {
                Some(base) => {
                    let at = base + 2 * dp * i as u16;
                    let replay = !config.kv_external || config.kv_external_replay;
                    (Some(at), replay.then_some(at + dp))
                }
                None => (None, None),
            };
            let mut args = vec![
                "--listen".to_string(),
                format!("127.0.0.1:{port}"),
                "--worker-id".into(),
                id.to_string(),
                "--model".into(),
                config.model.clone(),
                "--block-size".into(),
                config
                    .engine_block_size
                    .unwrap_or(config.block_size)
                    .to_string(),
                "--dp-size".into(),
                config.dp_size.to_string(),
            ];
            if let (Some(e), Some(r), false) = (events_port, replay_port, config.kv_external) {
                args.extend([
                    "--kv-events-endpoint".into(),
                    format!("tcp://127.0.0.1:{e}"),
                    "--kv-replay-endpoint".into(),
                    format!("tcp://127.0.0.1:{r}"),
                ]);
            }
            if let Some(t) = &config.thermal {
                args.extend(["--gpus".into(), t.gpus.to_string()]);
            }
            args.extend(config.sim_args.iter().cloned());
            args.extend(config.worker_sim_args.get(i).into_iter().flatten().cloned());
            let bootstrap_port = if config.bootstrap_ports
                && config.roles.get(i).map(String::as_str) == Some("prefill")
            {
                let p = next()?;
                args.extend(["--bootstrap-port".into(), p.to_string()]);
                Some(p)
            } else {
                None
            };
            workers.push(Worker {
                id,
                port,
                events_port,
                replay_port,
                bootstrap_port,
                args,
                proc: None,
            });
        }

        let mut stack = Stack {
            paths,
            config,
            gateways,
            workers,
            run_dir,
            tenant_key: jwt::new_key()?,
        };
        for i in 0..stack.workers.len() {
            stack.start_worker(i)?;
        }
        for w in &stack.workers {
            http::wait_for_status(&w.endpoint(), "/health", 200, Duration::from_secs(20))
                .with_context(|| format!("worker {} did not become healthy", w.id))?;
        }
        for g in 0..stack.gateways.len() {
            stack.start_sidecar(g, &[])?;
            if stack.config.extproc {
                stack.start_extproc(g)?;
            }
            stack.start_envoy(g)?;
        }
        for g in 0..stack.gateways.len() {
            stack.wait_gateway_ready(g, Duration::from_secs(60))?;
        }
        if stack.config.extproc {
            for g in 0..stack.gateways.len() {
                stack.wait_extproc_ready(g, Duration::from_secs(60))?;
            }
        }
        Ok(stack)
    }

    pub fn envoy_addr(&self) -> String {
        self.gateways[0].envoy_addr()
    }
    pub fn envoy_url(&self) -> String {
        format!("http://{}", self.envoy_addr())
    }
    pub fn plain_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.gateways[0].plain_port)
    }
    /// Envoy's least-request balancing over the workers (with
    /// [`StackConfig::extproc`]).
    pub fn least_request_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.gateways[0].least_request_port)
    }
    /// The kvgate route run by another build of the filter (with
    /// [`StackConfig::baseline_wasm`]).
    pub fn baseline_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.gateways[0].baseline_port)
    }
    /// Envoy deciding through `ext_proc` (with [`StackConfig::extproc`]).
    pub fn extproc_url(&self) -> String {
        format!("http://{}", self.extproc_addr())
    }
    pub fn extproc_addr(&self) -> String {
        format!("127.0.0.1:{}", self.gateways[0].extproc_port)
    }
    /// The HTTP API of `kvgate-extproc`'s in-process sidecar, whose ledger
    /// holds the ext_proc route's reservations.
    pub fn extproc_sidecar_addr(&self) -> String {
        self.gateways[0].extproc_sidecar_addr()
    }
    pub fn sidecar_addr(&self) -> String {
        self.gateways[0].sidecar_addr()
    }
    /// Envoy's control listener (`/busy_threshold`, `/workers`).
    pub fn control_addr(&self) -> String {
        self.gateways[0].control_addr()
    }

    /// [`Gateway::set_thresholds`] on the first gateway.
    pub fn set_thresholds(&self, patch: &serde_json::Value) -> Result<()> {
        self.gateways[0].set_thresholds(patch)
    }
    pub fn admin_addr(&self) -> String {
        self.gateways[0].admin_addr()
    }

    /// A bearer token Envoy accepts as proof of `tenant`, as an identity
    /// provider would issue it.
    pub fn tenant_token(&self, tenant: &str) -> String {
        jwt::sign_hs256(&self.tenant_key, &serde_json::json!({"tenant": tenant}))
    }

    /// Envoy's resident memory in bytes, from `/proc`.
    pub fn envoy_rss(&self) -> Option<u64> {
        process_rss(self.gateways[0].envoy.as_ref()?.pid())
    }

    /// Resident memory of the first gateway's sidecar, in bytes.
    pub fn sidecar_rss(&self) -> Option<u64> {
        process_rss(self.gateways[0].sidecar.as_ref()?.pid())
    }

    /// CPU seconds (user + system) used so far by Envoy, the sidecar and
    /// all workers together, from `/proc`.
    pub fn cpu_seconds(&self) -> [f64; 3] {
        let of = |p: Option<&Proc>| p.and_then(|p| process_cpu_seconds(p.pid())).unwrap_or(0.0);
        [
            of(self.gateways[0].envoy.as_ref()),
            of(self.gateways[0].sidecar.as_ref()),
            self.workers.iter().map(|w| of(w.proc.as_ref())).sum(),
        ]
    }

    /// Lowers the simulated workers to the least scheduling priority
    /// (nice 19). They stand in for GPU servers on other machines; on a
    /// shared 2-core box their tokenizers (every text prompt is tokenized
    /// as an engine would) otherwise preempt Envoy's worker threads in
    /// the middle of the decision a benchmark is timing.
    pub fn deprioritize_workers(&self) -> Result<()> {
        let pids: Vec<String> = self
            .workers
            .iter()
            .filter_map(|w| w.proc.as_ref().map(|p| p.pid().to_string()))
            .collect();
        if pids.is_empty() {
            return Ok(());
        }
        let out = std::process::Command::new("renice")
            .args(["-n", "19", "-p"])
            .args(&pids)
            .output()
            .context("running renice")?;
        if !out.status.success() {
            bail!(
                "renice of the workers failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// The first Envoy's threads, as their `/proc/PID/task/TID` folders:
    /// its main thread (xDS, stats, the snapshot service) and its worker
    /// threads (`wrk:*`, where requests and the filter run).
    fn envoy_threads(&self) -> Vec<(PathBuf, EnvoyThread)> {
        let Some(pid) = self.gateways[0].envoy.as_ref().map(Proc::pid) else {
            return Vec::new();
        };
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return Vec::new();
        };
        tasks
            .flatten()
            .filter_map(|task| {
                let dir = task.path();
                let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
                if comm.starts_with("wrk:") {
                    Some((dir, EnvoyThread::Worker))
                } else if task.file_name().to_str() == Some(&pid.to_string()) {
                    Some((dir, EnvoyThread::Main))
                } else {
                    None
                }
            })
            .collect()
    }

    /// The first Envoy's CPU seconds so far, split into its main thread
    /// and its worker threads.
    pub fn envoy_thread_cpu_seconds(&self) -> [f64; 2] {
        let mut out = [0.0; 2];
        for (dir, thread) in self.envoy_threads() {
            out[thread as usize] += thread_cpu_seconds(&dir).unwrap_or(0.0);
        }
        out
    }

    /// How often the first Envoy's worker threads have been preempted so
    /// far (`nonvoluntary_ctxt_switches`): on a shared machine, what sets
    /// most of a decision's P99.
    pub fn envoy_worker_preemptions(&self) -> u64 {
        self.envoy_threads()
            .into_iter()
            .filter(|(_, t)| *t == EnvoyThread::Worker)
            .filter_map(|(dir, _)| preemptions_of(&dir))
            .sum()
    }

    /// CPU seconds (user + system) used so far by `kvgate-extproc`; 0
    /// without it.
    pub fn extproc_cpu_seconds(&self) -> f64 {
        self.gateways[0]
            .extproc
            .as_ref()
            .and_then(|p| process_cpu_seconds(p.pid()))
            .unwrap_or(0.0)
    }

    /// Starts (or restarts) worker `i` with the arguments it was created with.
    pub fn start_worker(&mut self, i: usize) -> Result<()> {
        let w = &mut self.workers[i];
        let name = format!("worker-{}", w.id);
        let proc = Proc::spawn(&name, &self.paths.bin("kvgate-sim"), &w.args, &self.run_dir)?;
        w.proc = Some(proc);
        Ok(())
    }

    /// Kills worker `i` abruptly, as a crash would.
    pub fn kill_worker(&mut self, i: usize) {
        if let Some(mut p) = self.workers[i].proc.take() {
            p.kill();
        }
    }

    /// Kills the sidecar abruptly; Envoy keeps its last snapshot until it
    /// goes stale.
    pub fn kill_sidecar(&mut self) {
        self.kill_sidecar_of(0);
    }

    /// Kills gateway `g`'s sidecar.
    pub fn kill_sidecar_of(&mut self, g: usize) {
        if let Some(mut p) = self.gateways[g].sidecar.take() {
            p.kill();
        }
    }

    /// Restarts a killed sidecar with the same configuration.
    pub fn restart_sidecar(&mut self) -> Result<()> {
        self.restart_sidecar_of(0, &[])
    }

    /// Restarts gateway `g`'s sidecar with its configuration and `args`
    /// (e.g. `--indexer-peers`).
    pub fn restart_sidecar_of(&mut self, g: usize, args: &[String]) -> Result<()> {
        self.kill_sidecar_of(g);
        self.start_sidecar(g, args)
    }

    fn start_sidecar(&mut self, g: usize, extra_args: &[String]) -> Result<()> {
        let c = &self.config;
        let gw = &self.gateways[g];
        let mut toml = format!(
            "[server]\nlisten = \"127.0.0.1:{}\"\npublish_interval_ms = 20\n\n[scrape]\ninterval_ms = {}\ntimeout_ms = {}\ndown_after_ms = {}\n\n[[models]]\nname = \"{}\"\n{}\n",
            gw.sidecar_port,
            c.scrape_interval_ms,
            c.scrape_interval_ms.max(200),
            c.down_after_ms,
            c.model,
            c.model_toml
        );
        for (i, w) in self.workers.iter().enumerate() {
            toml.push_str(&format!(
                "\n[[workers]]\nworker_id = {}\nmodel_name = \"{}\"\nendpoint = \"{}\"\nblock_size = {}\ndata_parallel_size = {}\n",
                w.id,
                c.model,
                w.endpoint(),
                c.block_size,
                c.dp_size
            ));
            if let Some(t) = c.tenants.get(i) {
                toml.push_str(&format!("tenant_id = \"{t}\"\n"));
            }
            if let Some(r) = c.roles.get(i) {
                toml.push_str(&format!("role = \"{r}\"\n"));
            }
            if let Some(p) = w.bootstrap_port {
                toml.push_str(&format!("bootstrap_port = {p}\n"));
            }
            if let Some(t) = &c.thermal {
                toml.push_str(&format!(
                    "gpus = {:?}\nbatch_control = {}\n",
                    w.gpu_uuids(t.gpus),
                    t.batch_control
                ));
            }
            if let Some(e) = w.events_port {
                if let Some(r) = w.replay_port {
                    toml.push_str(&format!("replay_endpoint = \"tcp://127.0.0.1:{r}\"\n"));
                }
                toml.push_str("[workers.kv_events_endpoints]\n");
                for rank in 0..c.dp_size {
                    toml.push_str(&format!(
                        "\"{rank}\" = \"tcp://127.0.0.1:{}\"\n",
                        e as u32 + rank
                    ));
                }
            }
        }
        if let Some(t) = &c.thermal {
            let urls: Vec<String> = self
                .workers
                .iter()
                .map(|w| format!("http://{}/dcgm/metrics", w.endpoint()))
                .collect();
            toml.push_str(&format!("\n[thermal]\ndcgm_urls = {urls:?}\n{}\n", t.toml));
        }
        if c.selection_api {
            toml.push_str(&format!(
                "\n[selection]\nlisten = \"127.0.0.1:{}\"\n",
                gw.selection_port
            ));
        }
        if c.replica_sync {
            let peers: Vec<String> = self
                .gateways
                .iter()
                .filter(|o| o.tag != gw.tag)
                .map(|o| format!("tcp://127.0.0.1:{}", o.sync_port))
                .collect();
            toml.push_str(&format!(
                "\n[replica_sync]\nlisten = \"127.0.0.1:{}\"\npeers = {peers:?}\n",
                gw.sync_port
            ));
        }
        if let Some(token) = &c.control_token {
            let file = self.run_dir.join("control.token");
            std::fs::write(&file, token).context("writing the control token")?;
            toml = format!("[control]\ntoken_file = \"{}\"\n\n{toml}", file.display());
        }
        let path = self.run_dir.join(format!("sidecar{}.toml", gw.tag));
        if !path.exists() {
            std::fs::write(&path, toml).context("writing sidecar.toml")?;
        }
        let mut args = vec!["--config".to_string(), path.display().to_string()];
        args.extend(extra_args.iter().cloned());
        let proc = Proc::spawn(
            &format!("sidecar{}", gw.tag),
            &self.paths.bin("kvgate-sidecar"),
            &args,
            &self.run_dir,
        )?;
        let addr = gw.sidecar_addr();
        self.gateways[g].sidecar = Some(proc);
        http::wait_for_status(&addr, "/health", 200, Duration::from_secs(20))
            .context("sidecar did not come up")
            .map_err(|e| self.explain(e))?;
        Ok(())
    }

    /// Starts gateway `g`'s `kvgate-extproc` with its sidecar's
    /// configuration, so that its in-process sidecar scrapes the same
    /// workers; its HTTP API and gRPC listener get ports of their own.
    fn start_extproc(&mut self, g: usize) -> Result<()> {
        let gw = &self.gateways[g];
        let config = self.run_dir.join(format!("sidecar{}.toml", gw.tag));
        let args = vec![
            "--config".to_string(),
            config.display().to_string(),
            "--grpc-listen".into(),
            format!("127.0.0.1:{}", gw.extproc_grpc_port),
            "--listen".into(),
            gw.extproc_sidecar_addr(),
        ];
        let proc = Proc::spawn(
            &format!("extproc{}", gw.tag),
            &self.paths.bin("kvgate-extproc"),
            &args,
            &self.run_dir,
        )?;
        let addr = gw.extproc_sidecar_addr();
        self.gateways[g].extproc = Some(proc);
        http::wait_for_status(&addr, "/health", 200, Duration::from_secs(20))
            .context("kvgate-extproc did not come up")
            .map_err(|e| self.explain(e))?;
        Ok(())
    }

    /// Waits until `kvgate-extproc`'s sidecar sees every running worker up.
    fn wait_extproc_ready(&self, g: usize, timeout: Duration) -> Result<()> {
        let want = self.workers.iter().filter(|w| w.proc.is_some()).count();
        let gw = &self.gateways[g];
        let deadline = Instant::now() + timeout;
        loop {
            let up = gw.extproc_workers_up().unwrap_or(0);
            if up >= want {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.explain(anyhow::anyhow!(
                    "kvgate-extproc at gateway{} sees {up}/{want} workers up",
                    gw.tag
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn start_envoy(&mut self, g: usize) -> Result<()> {
        let gw = &self.gateways[g];
        let mut overrides = self.config.plugin.clone();
        // The snapshot service authenticates its bookings and reports.
        if let (Some(token), Some(o)) = (&self.config.control_token, overrides.as_object_mut()) {
            o.entry("sidecar_token")
                .or_insert_with(|| serde_json::Value::String(token.clone()));
        }
        if let (true, Some(o)) = (self.config.http_filter_only, overrides.as_object_mut()) {
            o.entry("poller")
                .or_insert_with(|| serde_json::Value::String("lease".into()));
        }
        let plugin = envoy::plugin_config(&overrides);
        let endpoints: Vec<String> = self.workers.iter().map(Worker::endpoint).collect();
        let mut yaml = envoy::render(
            &self.paths.repo.join("envoy/envoy.yaml"),
            &envoy::Vars {
                admin_port: gw.admin_port,
                listen_port: gw.envoy_port,
                plain_port: gw.plain_port,
                sidecar_port: gw.sidecar_port,
                control_port: gw.control_port,
                wasm_path: self.paths.wasm.display().to_string(),
                plugin_config: plugin,
                fallback: endpoints,
                tenant_jwks: jwt::jwks(&self.tenant_key),
            },
        )?;
        if self.config.http_filter_only {
            yaml = envoy::without_snapshot_service(&yaml)?;
        }
        if let Some(wasm) = &self.config.baseline_wasm {
            yaml = envoy::with_baseline(
                &yaml,
                gw.envoy_port,
                &self.paths.wasm.display().to_string(),
                gw.baseline_port,
                &wasm.display().to_string(),
            )?;
        }
        if self.config.extproc {
            yaml = envoy::with_comparison(
                &yaml,
                &envoy::Comparison {
                    least_request_port: gw.least_request_port,
                    extproc_port: gw.extproc_port,
                    extproc_grpc_port: gw.extproc_grpc_port,
                    workers: self.workers.iter().map(Worker::endpoint).collect(),
                },
            )?;
        }
        let path = self.run_dir.join(format!("envoy{}.yaml", gw.tag));
        std::fs::write(&path, yaml).context("writing envoy.yaml")?;
        let args = vec![
            "-c".to_string(),
            path.display().to_string(),
            "--concurrency".into(),
            self.config.envoy_concurrency.to_string(),
            "--log-level".into(),
            "warn".into(),
            "--component-log-level".into(),
            "wasm:info".into(),
            "--base-id".into(),
            // Distinct per stack so parallel stacks never share Envoy's hot
            // restart shared memory.
            (u32::from(gw.admin_port)).to_string(),
        ];
        let proc = Proc::spawn(
            &format!("envoy{}", gw.tag),
            &self.paths.envoy,
            &args,
            &self.run_dir,
        )?;
        let admin = gw.admin_addr();
        self.gateways[g].envoy = Some(proc);
        http::wait_for_status(&admin, "/ready", 200, Duration::from_secs(60))
            .context("envoy did not become ready")
            .map_err(|e| self.explain(e))?;
        Ok(())
    }

    /// Waits until the first gateway's filter has a snapshot in which every
    /// worker is up, served by the sidecar now running (versions restart
    /// with it).
    pub fn wait_routing_ready(&self, timeout: Duration) -> Result<()> {
        self.wait_gateway_ready(0, timeout)
    }

    /// [`Stack::wait_routing_ready`] for gateway `g`.
    pub fn wait_gateway_ready(&self, g: usize, timeout: Duration) -> Result<()> {
        let want = self.workers.iter().filter(|w| w.proc.is_some()).count();
        self.gateways[g]
            .wait_ready(want, self.workers.len(), timeout)
            .map_err(|e| self.explain(e))
    }

    pub fn routed_members(&self) -> Result<usize> {
        self.gateways[0].routed_members()
    }

    pub fn sidecar_metric(&self, series: &str) -> Result<f64> {
        self.gateways[0].sidecar_metric(series)
    }

    pub fn sidecar_state(&self) -> Result<serde_json::Value> {
        self.gateways[0].sidecar_state()
    }

    pub fn sidecar_workers_up(&self) -> Result<usize> {
        self.gateways[0].sidecar_workers_up()
    }

    pub fn envoy_stat(&self, name: &str) -> Result<u64> {
        self.gateways[0].envoy_stat(name)
    }

    /// The tail of every process log, for failure messages.
    pub fn log_tails(&self) -> String {
        process::tails(&self.run_dir, 40)
    }

    fn explain(&self, e: anyhow::Error) -> anyhow::Error {
        e.context(format!(
            "process logs in {}:\n{}",
            self.run_dir.display(),
            self.log_tails()
        ))
    }
}

impl Gateway {
    pub fn envoy_addr(&self) -> String {
        format!("127.0.0.1:{}", self.envoy_port)
    }
    /// Envoy's control listener, in front of this gateway's sidecar.
    pub fn control_addr(&self) -> String {
        format!("127.0.0.1:{}", self.control_port)
    }

    /// Changes a model's busy thresholds live (`POST /busy_threshold` on
    /// the control listener, `{"model": .., <thresholds>}`); an error
    /// unless it answers 200. The filter has them once a snapshot that
    /// carries them reaches Envoy.
    pub fn set_thresholds(&self, patch: &serde_json::Value) -> Result<()> {
        let (status, body) = http::request(
            &self.control_addr(),
            "POST",
            "/busy_threshold",
            &[("content-type", "application/json")],
            Some(patch.to_string().as_bytes()),
        )?;
        if status != 200 {
            bail!(
                "busy_threshold: {status} {}",
                String::from_utf8_lossy(&body)
            );
        }
        Ok(())
    }
    pub fn sidecar_addr(&self) -> String {
        format!("127.0.0.1:{}", self.sidecar_port)
    }
    pub fn admin_addr(&self) -> String {
        format!("127.0.0.1:{}", self.admin_port)
    }
    /// The sidecar's selection API, when the stack serves it.
    pub fn selection_addr(&self) -> String {
        format!("127.0.0.1:{}", self.selection_port)
    }
    /// The sidecar's process id, while it runs.
    pub fn sidecar_pid(&self) -> Option<u32> {
        self.sidecar.as_ref().map(Proc::pid)
    }
    /// `kvgate-extproc`'s in-process sidecar, when the stack runs it.
    pub fn extproc_sidecar_addr(&self) -> String {
        format!("127.0.0.1:{}", self.extproc_sidecar_port)
    }

    /// Workers up in `kvgate-extproc`'s in-process sidecar's snapshot.
    pub fn extproc_workers_up(&self) -> Result<usize> {
        let (status, body) = http::get(&self.extproc_sidecar_addr(), "/v1/state")?;
        if status != 200 {
            bail!("kvgate-extproc /v1/state answered {status}");
        }
        Ok(workers_listed(&serde_json::from_slice(&body)?))
    }

    /// Waits until the filter has a snapshot in which `want` workers are
    /// up, served by the sidecar now running (versions restart with it),
    /// and the routed cluster holds all `members`.
    fn wait_ready(&self, want: usize, members_want: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let up = self.sidecar_workers_up().unwrap_or(0);
            let version = self.envoy_stat("kvgate_snapshot_version").unwrap_or(0);
            let sidecar_version = self
                .sidecar_state()
                .ok()
                .and_then(|s| s["version"].as_u64())
                .unwrap_or(0);
            let served = self
                .sidecar_metric("kvgate_sidecar_snapshot_polls_total{result=\"changed\"}")
                .unwrap_or(0.0);
            let members = self.routed_members().unwrap_or(0);
            if up >= want
                && members >= members_want
                && version > 0
                && version == sidecar_version
                && served >= 1.0
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "routing not ready at gateway{}: sidecar reports {up}/{want} workers up, envoy's routed cluster has {members}/{members_want} members, envoy snapshot version {version}, sidecar version {sidecar_version}, full polls served {served}",
                    self.tag
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// How many workers Envoy's routed cluster holds (from the sidecar's
    /// catalog, over EDS).
    pub fn routed_members(&self) -> Result<usize> {
        Ok(self.admin_stat("cluster.kvgate_workers.membership_total")? as usize)
    }

    /// One sample from the sidecar's `/metrics`, by its exact series name.
    pub fn sidecar_metric(&self, series: &str) -> Result<f64> {
        let (status, body) = http::get(&self.sidecar_addr(), "/metrics")?;
        if status != 200 {
            bail!("sidecar /metrics answered {status}");
        }
        let text = String::from_utf8_lossy(&body);
        Ok(text
            .lines()
            .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0.0))
    }

    /// The sidecar's JSON view of the current snapshot.
    pub fn sidecar_state(&self) -> Result<serde_json::Value> {
        let (status, body) = http::get(&self.sidecar_addr(), "/v1/state")?;
        if status != 200 {
            bail!("sidecar /v1/state answered {status}");
        }
        Ok(serde_json::from_slice(&body)?)
    }

    /// Number of workers the current snapshot lists (all models).
    pub fn sidecar_workers_up(&self) -> Result<usize> {
        Ok(workers_listed(&self.sidecar_state()?))
    }

    /// Reads one of the filter's metrics from Envoy's admin `/stats`.
    pub fn envoy_stat(&self, name: &str) -> Result<u64> {
        self.admin_stat(&format!("wasmcustom.{name}"))
    }

    /// One of Envoy's stats by its full name; 0 while it does not exist.
    fn admin_stat(&self, full: &str) -> Result<u64> {
        let filter = format!("^{}$", full.replace('.', "\\."));
        let (status, body) = http::get(&self.admin_addr(), &format!("/stats?filter={filter}"))?;
        if status != 200 {
            bail!("envoy /stats answered {status}");
        }
        let text = String::from_utf8_lossy(&body);
        for line in text.lines() {
            if let Some((k, v)) = line.split_once(": ")
                && k.trim() == full
            {
                return Ok(v.trim().parse().unwrap_or(0));
            }
        }
        Ok(0)
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        for g in &mut self.gateways {
            for mut p in [g.envoy.take(), g.sidecar.take(), g.extproc.take()]
                .into_iter()
                .flatten()
            {
                p.kill();
            }
        }
        for w in &mut self.workers {
            if let Some(mut p) = w.proc.take() {
                p.kill();
            }
        }
    }
}

/// Workers a snapshot's JSON view lists, all models together.
fn workers_listed(state: &serde_json::Value) -> usize {
    state["models"]
        .as_array()
        .map(|ms| {
            ms.iter()
                .map(|m| m["workers"].as_array().map_or(0, Vec::len))
                .sum()
        })
        .unwrap_or(0)
}

/// CPU seconds (user + system) a process has used, from `/proc/PID/stat`.
pub fn process_cpu_seconds(pid: u32) -> Option<f64> {
    cpu_seconds_of(Path::new(&format!("/proc/{pid}/stat")))
}

/// Which of Envoy's threads: the index into
/// [`Stack::envoy_thread_cpu_seconds`]'s answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EnvoyThread {
    Main = 0,
    Worker = 1,
}

/// A thread's involuntary context switches so far, from its
/// `/proc/PID/task/TID` folder.
fn preemptions_of(task: &Path) -> Option<u64> {
    let status = std::fs::read_to_string(task.join("status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("nonvoluntary_ctxt_switches:"))?
        .trim()
        .parse()
        .ok()
}

/// CPU seconds a thread has run, from its `/proc/PID/task/TID` folder:
/// `schedstat`'s nanoseconds where the kernel keeps them (a request's
/// share of a thread is tens of microseconds, the `stat` file's clock
/// ticks are 10 ms), else `stat`. A process's total stays on `stat`,
/// which keeps the time of its threads that have exited.
fn thread_cpu_seconds(task: &Path) -> Option<f64> {
    let ns = std::fs::read_to_string(task.join("schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
    match ns {
        Some(ns) => Some(ns as f64 / 1e9),
        None => cpu_seconds_of(&task.join("stat")),
    }
}

/// CPU seconds (user + system) of a process's or a thread's `stat` file.
fn cpu_seconds_of(stat_path: &Path) -> Option<f64> {
    let stat = std::fs::read_to_string(stat_path).ok()?;
    // Fields after the parenthesised command name; utime and stime are
    // the 14th and 15th of the whole line, in clock ticks (100 a second on
    // Linux).
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

/// A process's resident memory in bytes, from `/proc`.
pub fn process_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_threads_preemptions_are_read() {
        assert!(preemptions_of(Path::new("/proc/thread-self")).is_some());
        assert_eq!(preemptions_of(Path::new("/proc/no-such-task")), None);
    }

    #[test]
    fn a_threads_cpu_time_is_read_below_a_clock_tick() {
        let me = Path::new("/proc/thread-self");
        let before = thread_cpu_seconds(me).unwrap();
        let spin = Instant::now();
        let mut x = 0u64;
        while spin.elapsed() < Duration::from_millis(30) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let after = thread_cpu_seconds(me).unwrap();
        assert!(after > before, "{before} then {after}");
        if me.join("schedstat").exists() {
            // Nanoseconds: a whole number of 10 ms ticks would be chance.
            let ticks = after * 100.0;
            assert!((ticks - ticks.round()).abs() > 1e-9, "{after}");
        }
    }
}
