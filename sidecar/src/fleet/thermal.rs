//! The thermal controller: per worker, from the hottest GPU of its
//! tensor-parallel group to a state, a heat that prices it and, while it
//! throttles, a cap on the requests it holds.
//!
//! Hysteresis (the seed's §4.1.1): throttling starts when the hottest GPU
//! reaches the target, or reports a thermal or hardware slowdown, and ends
//! only below `target − hysteresis`, so a GPU hovering at the line does not
//! enter and leave with every reading. While throttling the cap is
//! proportional, `base − gain × (T − target)`, less a slow integral term
//! that keeps cutting while the GPU stays over its target (a proportional
//! cap alone settles above it whenever cooling got worse) and gives the
//! cut back as it cools. `base` is what the worker held when throttling
//! began. Cap changes are rate-limited; a slowdown cuts at once.
//!
//! No fresh reading is *unknown*, never cool: the worker is priced as hot
//! and a cap it has is held until a reading says it may go.

use super::Fleet;
use crate::config::{ThermalOverride, ThermalSettings};
use crate::sources::thermal::GpuReading;
use kvgate_core::{Thermal, ThermalState};
use std::time::{Duration, Instant};

/// A step longer than this (a stalled loop) counts as this long.
const MAX_STEP: Duration = Duration::from_secs(5);

/// A GPU's latest reading and when it was taken.
#[derive(Debug, Clone)]
pub struct GpuSeen {
    pub reading: GpuReading,
    pub at: Instant,
}

/// The hottest fresh GPU of a worker, as one step sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Hottest {
    pub uuid: String,
    pub temp_c: f64,
    /// Any GPU of the group reports a thermal or hardware slowdown.
    pub slowing: bool,
}

/// What a step changed, for the engine and the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    None,
    Entered,
    CapChanged,
    Exited,
}

#[derive(Debug, Clone, Default)]
pub struct Controller {
    throttling: bool,
    cap: u32,
    base: u32,
    trim: f64,
    state: ThermalState,
    heat: f64,
    last_step: Option<Instant>,
    last_change: Option<Instant>,
    /// Times the worker started throttling.
    pub entries: u64,
    /// Set through `POST /v1/admin/thermal` for this worker alone.
    pub overrides: ThermalOverride,
    /// The hottest GPU at the last fresh reading.
    pub hottest: Option<Hottest>,
    /// The engine's `max_num_seqs` before the controller first cut it:
    /// what it gets back when throttling ends.
    pub restore_max_num_seqs: Option<u32>,
}

impl Controller {
    pub fn state(&self) -> ThermalState {
        self.state
    }

    pub fn cap(&self) -> u32 {
        self.cap
    }

    pub fn heat(&self) -> f64 {
        self.heat
    }

    /// What the snapshot carries for the worker.
    pub fn published(&self, in_flight: u32) -> Thermal {
        Thermal {
            state: self.state,
            heat: self.heat,
            cap: self.cap,
            in_flight,
        }
    }

    /// A worker that watches no GPU: nothing to say.
    pub fn unmonitored(&mut self) {
        *self = Controller {
            overrides: self.overrides,
            entries: self.entries,
            ..Controller::default()
        };
    }

    /// One reading of the worker's GPUs (`None`: none fresh) while it holds
    /// `in_flight` requests.
    pub fn step(
        &mut self,
        hottest: Option<Hottest>,
        in_flight: u32,
        s: &ThermalSettings,
        min_change: Duration,
        now: Instant,
    ) -> Change {
        let dt = self
            .last_step
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t))
            .min(MAX_STEP);
        self.last_step = Some(now);
        let Some(h) = hottest else {
            // Not cool: priced as hot, and a cap held, until a reading.
            self.state = ThermalState::Unknown;
            self.heat = if s.enabled { 1.0 } else { 0.0 };
            if !s.enabled && self.throttling {
                return self.exit(now);
            }
            return Change::None;
        };
        let t = h.temp_c;
        let slowing = h.slowing;
        self.hottest = Some(h);
        let mut change = Change::None;
        if !self.throttling && s.enabled && (t >= s.target_c || slowing) {
            self.throttling = true;
            self.entries += 1;
            self.base = in_flight.max(1);
            self.trim = 0.0;
            self.cap = self.desired(t, slowing, s);
            self.last_change = Some(now);
            change = Change::Entered;
        } else if self.throttling && (!s.enabled || (t < s.target_c - s.hysteresis_c && !slowing)) {
            change = self.exit(now);
        } else if self.throttling {
            let err = over(t, slowing, s);
            let limit = f64::from(self.base.saturating_sub(1));
            if s.integral_s > 0.0 {
                self.trim =
                    (self.trim + s.gain * err * dt.as_secs_f64() / s.integral_s).clamp(0.0, limit);
            }
            let want = self.desired(t, slowing, s);
            let due = self
                .last_change
                .is_none_or(|c| now.saturating_duration_since(c) >= min_change);
            if want != self.cap && (due || (slowing && want < self.cap)) {
                self.cap = want;
                self.last_change = Some(now);
                change = Change::CapChanged;
            }
        }
        let warm_from = s.target_c - s.warm_band_c;
        self.state = if self.throttling {
            ThermalState::Throttling
        } else if t >= warm_from {
            ThermalState::Warm
        } else {
            ThermalState::Cool
        };
        self.heat = if !s.enabled {
            0.0
        } else if self.throttling {
            1.0
        } else {
            ((t - warm_from) / s.warm_band_c).clamp(0.0, 1.0)
        };
        change
    }

    fn exit(&mut self, now: Instant) -> Change {
        self.throttling = false;
        self.cap = 0;
        self.trim = 0.0;
        self.last_change = Some(now);
        Change::Exited
    }

    /// The cap for temperature `t`: proportional below the base, less the
    /// integral term, at least 1.
    fn desired(&self, t: f64, slowing: bool, s: &ThermalSettings) -> u32 {
        let cut = s.gain * over(t, slowing, s).max(0.0) + self.trim;
        let cap = (f64::from(self.base) - cut).round();
        (cap.max(1.0) as u32).min(self.base.max(1))
    }

    /// The cap this step would set with other settings, for a dry run:
    /// entering at the current temperature if not throttling yet.
    pub fn preview(&self, in_flight: u32, s: &ThermalSettings) -> (ThermalState, u32) {
        let Some(h) = &self.hottest else {
            return (self.state, self.cap);
        };
        let mut c = self.clone();
        c.last_change = None;
        if !c.throttling {
            c.base = in_flight.max(1);
        }
        let t = h.temp_c;
        let hot = t >= s.target_c || h.slowing;
        let stays = c.throttling && (t >= s.target_c - s.hysteresis_c || h.slowing);
        if s.enabled && (hot || stays) {
            (ThermalState::Throttling, c.desired(t, h.slowing, s))
        } else if t >= s.target_c - s.warm_band_c {
            (ThermalState::Warm, 0)
        } else {
            (ThermalState::Cool, 0)
        }
    }
}

/// Degrees over the target; a slowdown counts as at least a hysteresis
/// over, so it always bites.
fn over(t: f64, slowing: bool, s: &ThermalSettings) -> f64 {
    let err = t - s.target_c;
    if slowing {
        err.max(s.hysteresis_c)
    } else {
        err
    }
}

/// One worker's step, for the caller to act on.
#[derive(Debug, Clone, PartialEq)]
pub struct Stepped {
    pub worker_id: u64,
    pub change: Change,
    pub cap: u32,
    /// Requests the engine runs now (its ranks' running, summed).
    pub running: u32,
    /// Hot enough that the running batch must shrink now, not as requests
    /// finish: a hysteresis over the target, or a slowdown. Evicting costs
    /// the evicted requests their place (the seed's §4.1.2), so it is kept
    /// for when waiting is worse.
    pub evict: bool,
}

impl Fleet {
    /// Sets a model's thermal overrides. False when the model is not
    /// configured.
    pub fn set_model_thermal(&mut self, model: &str, o: ThermalOverride) -> bool {
        self.models.get_mut(model).map(|m| m.thermal = o).is_some()
    }

    /// Sets a worker's own thermal overrides. False when there is no such
    /// worker.
    pub fn set_worker_thermal(&mut self, id: u64, o: ThermalOverride) -> bool {
        self.workers
            .get_mut(&id)
            .map(|w| w.thermal.overrides = o)
            .is_some()
    }

    /// Remembers the batch size a worker ran with before its first cut,
    /// so that it is given back when the worker cools. The first one kept
    /// stands: a later probe would read an already cut size.
    pub fn remember_restore(&mut self, id: u64, max_num_seqs: u32) {
        if let Some(w) = self.workers.get_mut(&id) {
            w.thermal.restore_max_num_seqs.get_or_insert(max_num_seqs);
        }
    }

    /// Records GPU readings taken at `at`.
    pub fn record_gpus(&mut self, readings: Vec<GpuReading>, at: Instant) {
        for r in readings {
            self.gpus.insert(r.uuid.clone(), GpuSeen { reading: r, at });
        }
    }

    /// A worker's fresh GPUs, hottest first.
    pub fn gpus_of(&self, id: u64, now: Instant, stale_after: Duration) -> Vec<&GpuSeen> {
        let Some(w) = self.workers.get(&id) else {
            return Vec::new();
        };
        if !w.spec.watches_gpus() {
            return Vec::new();
        }
        let mut g: Vec<&GpuSeen> = self
            .gpus
            .values()
            .filter(|g| now.saturating_duration_since(g.at) <= stale_after)
            .filter(|g| w.spec.owns_gpu(&g.reading.uuid, &g.reading.labels))
            .collect();
        g.sort_by(|a, b| b.reading.temp_c.total_cmp(&a.reading.temp_c));
        g
    }

    /// The settings a worker's controller runs with: the file's, its
    /// model's, then its own overrides.
    pub fn thermal_settings(&self, id: u64, file: &crate::config::Config) -> ThermalSettings {
        let Some(w) = self.workers.get(&id) else {
            return ThermalSettings::default();
        };
        let model = self
            .models
            .get(&w.spec.model_name)
            .map(|m| file.thermal_settings(m))
            .unwrap_or_else(|| ThermalSettings::default().with(&file.thermal.settings));
        model.with(&w.thermal.overrides)
    }

    /// Steps every watching worker's controller on the readings so far.
    pub fn step_thermal(&mut self, file: &crate::config::Config, now: Instant) -> Vec<Stepped> {
        let stale_after = file.thermal.stale_after;
        let min_change = file.thermal.min_change_interval;
        let ids: Vec<u64> = self.workers.keys().copied().collect();
        let mut out = Vec::new();
        for id in ids {
            let settings = self.thermal_settings(id, file);
            let hottest = {
                let gpus = self.gpus_of(id, now, stale_after);
                gpus.first().map(|g| Hottest {
                    uuid: g.reading.uuid.clone(),
                    temp_c: g.reading.temp_c,
                    slowing: gpus.iter().any(|g| g.reading.slowing()),
                })
            };
            let Some(w) = self.workers.get_mut(&id) else {
                continue;
            };
            if !w.spec.watches_gpus() {
                w.thermal.unmonitored();
                continue;
            }
            let evict = hottest.as_ref().is_some_and(|h| {
                h.slowing || h.temp_c >= settings.target_c + settings.hysteresis_c
            });
            let change = w
                .thermal
                .step(hottest, w.in_flight, &settings, min_change, now);
            out.push(Stepped {
                worker_id: id,
                change,
                cap: w.thermal.cap(),
                running: w.ranks.iter().map(|r| r.running).sum(),
                evict,
            });
        }
        // Readings no worker can use any more are dropped once stale.
        self.gpus
            .retain(|_, g| now.saturating_duration_since(g.at) <= stale_after * 4);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hot(t: f64) -> Option<Hottest> {
        Some(Hottest {
            uuid: "GPU-a".into(),
            temp_c: t,
            slowing: false,
        })
    }

    const S: ThermalSettings = ThermalSettings {
        target_c: 80.0,
        hysteresis_c: 3.0,
        gain: 1.0,
        integral_s: 10.0,
        warm_band_c: 8.0,
        policy: crate::config::EvictPolicy::Lru,
        enabled: true,
    };
    const GAP: Duration = Duration::from_secs(2);

    #[test]
    fn hysteresis_enters_at_the_target_and_leaves_below_it() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut c = Controller::default();
        assert_eq!(c.step(hot(70.0), 10, &S, GAP, at(0)), Change::None);
        assert_eq!((c.state(), c.cap(), c.heat()), (ThermalState::Cool, 0, 0.0));
        c.step(hot(76.0), 10, &S, GAP, at(1));
        assert_eq!(c.state(), ThermalState::Warm);
        assert!((c.heat() - 0.5).abs() < 1e-9, "4 of the 8 °C band");
        assert_eq!(c.step(hot(80.0), 10, &S, GAP, at(2)), Change::Entered);
        assert_eq!(
            (c.state(), c.cap(), c.entries),
            (ThermalState::Throttling, 10, 1)
        );
        // Just under the target, and under it by less than the hysteresis:
        // still throttling.
        for (s, t) in [(3, 79.9), (4, 77.5), (5, 77.01)] {
            assert_ne!(c.step(hot(t), 10, &S, GAP, at(s)), Change::Exited, "{t}");
            assert_eq!(c.state(), ThermalState::Throttling);
        }
        assert_eq!(c.step(hot(76.9), 10, &S, GAP, at(6)), Change::Exited);
        assert_eq!((c.state(), c.cap()), (ThermalState::Warm, 0));
        assert_eq!(c.entries, 1);
    }

    #[test]
    fn the_cap_is_proportional_rate_limited_and_at_least_one() {
        let t0 = Instant::now();
        let ms = |m: u64| t0 + Duration::from_millis(m);
        let mut c = Controller::default();
        assert_eq!(c.step(hot(84.0), 20, &S, GAP, ms(0)), Change::Entered);
        assert_eq!(c.cap(), 16, "20 − 1 × 4 °C");
        // Hotter a second later: not yet due.
        assert_eq!(c.step(hot(88.0), 20, &S, GAP, ms(1000)), Change::None);
        assert_eq!(c.cap(), 16);
        assert_eq!(c.step(hot(88.0), 20, &S, GAP, ms(2000)), Change::CapChanged);
        let cap = c.cap();
        assert!(cap <= 12, "20 − 8, less what the integral took: {cap}");
        let mut fierce = c.clone();
        let steep = ThermalSettings { gain: 100.0, ..S };
        fierce.step(hot(95.0), 20, &steep, GAP, ms(5000));
        assert_eq!(fierce.cap(), 1, "never below one");
    }

    #[test]
    fn the_integral_term_keeps_cutting_while_over_and_gives_back_while_under() {
        let t0 = Instant::now();
        let mut c = Controller::default();
        c.step(hot(81.0), 20, &S, GAP, t0);
        assert_eq!(c.cap(), 19);
        // A GPU that stays 1 °C over, however long: P alone would hold 19.
        let mut caps = Vec::new();
        for s in 1..=60 {
            c.step(hot(81.0), 20, &S, GAP, t0 + Duration::from_secs(s));
            caps.push(c.cap());
        }
        assert!(caps.windows(2).all(|w| w[1] <= w[0]), "{caps:?}");
        assert!(*caps.last().unwrap() <= 14, "{caps:?}");
        // Back under the target, within the hysteresis: the cap comes back.
        let low = *caps.last().unwrap();
        for s in 61..=120 {
            c.step(hot(78.0), 20, &S, GAP, t0 + Duration::from_secs(s));
        }
        assert!(c.cap() > low, "{} after {low}", c.cap());
        assert_eq!(c.state(), ThermalState::Throttling);
    }

    #[test]
    fn a_slowdown_throttles_below_the_target_and_cuts_at_once() {
        let t0 = Instant::now();
        let slowing = |t| {
            Some(Hottest {
                uuid: "GPU-a".into(),
                temp_c: t,
                slowing: true,
            })
        };
        let mut c = Controller::default();
        assert_eq!(c.step(slowing(70.0), 10, &S, GAP, t0), Change::Entered);
        assert_eq!(c.cap(), 7, "a slowdown counts as a hysteresis over");
        c.step(hot(85.0), 10, &S, GAP, t0 + Duration::from_millis(100));
        let before = c.cap();
        assert_eq!(
            c.step(slowing(90.0), 10, &S, GAP, t0 + Duration::from_millis(200)),
            Change::CapChanged,
            "no waiting for the rate limit"
        );
        assert!(c.cap() < before);
        // Cool, but still slowing: stays throttling.
        assert_ne!(
            c.step(slowing(60.0), 10, &S, GAP, t0 + Duration::from_secs(1)),
            Change::Exited
        );
    }

    #[test]
    fn no_reading_is_unknown_not_cool_and_holds_the_cap() {
        let t0 = Instant::now();
        let mut c = Controller::default();
        c.step(hot(85.0), 10, &S, GAP, t0);
        let cap = c.cap();
        assert!(cap > 0);
        for s in 1..30 {
            assert_eq!(
                c.step(None, 0, &S, GAP, t0 + Duration::from_secs(s)),
                Change::None
            );
        }
        assert_eq!(
            (c.state(), c.cap(), c.heat()),
            (ThermalState::Unknown, cap, 1.0)
        );
        let mut never = Controller::default();
        never.step(None, 3, &S, GAP, t0);
        assert_eq!(
            (never.state(), never.cap(), never.heat()),
            (ThermalState::Unknown, 0, 1.0),
            "never read: priced as hot, not capped"
        );
    }

    #[test]
    fn disabled_reports_without_acting() {
        let t0 = Instant::now();
        let off = ThermalSettings {
            enabled: false,
            ..S
        };
        let mut c = Controller::default();
        assert_eq!(c.step(hot(90.0), 10, &off, GAP, t0), Change::None);
        assert_eq!((c.state(), c.cap(), c.heat()), (ThermalState::Warm, 0, 0.0));
        // Turned off mid-throttle: released.
        c.step(hot(90.0), 10, &S, GAP, t0 + Duration::from_secs(1));
        assert!(c.cap() > 0);
        assert_eq!(
            c.step(hot(90.0), 10, &off, GAP, t0 + Duration::from_secs(2)),
            Change::Exited
        );
    }

    #[test]
    fn a_preview_changes_nothing() {
        let t0 = Instant::now();
        let mut c = Controller::default();
        c.step(hot(78.0), 12, &S, GAP, t0);
        let lower = ThermalSettings {
            target_c: 75.0,
            ..S
        };
        assert_eq!(c.preview(12, &lower), (ThermalState::Throttling, 9));
        assert_eq!((c.state(), c.cap()), (ThermalState::Warm, 0));
        assert_eq!(c.preview(12, &S), (ThermalState::Warm, 0));
    }
}
