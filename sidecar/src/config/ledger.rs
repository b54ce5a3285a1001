//! `[load.caps]`: how many holders the load ledger keeps.
//!
//! Every way a holder enters the ledger is outside input (the gateways'
//! booking batches, the selection API, replica-sync peers), and each holder
//! costs memory until it ends or expires, so each way has a cap. Origins
//! name themselves (a gateway VM by a random tag, a peer by its process
//! id), so a per-origin cap alone could be dodged by taking new names:
//! each kind also has a cap for all its origins together, and the ledger
//! one for everything.

use serde::Deserialize;

/// The most holders the ledger may keep, by who booked them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LedgerCaps {
    /// Every holder together.
    pub holders: usize,
    /// One origin: one of this sidecar's gateway VMs, the selection API,
    /// or one replica-sync peer.
    pub holders_per_origin: usize,
    /// This sidecar's gateway VMs together.
    pub gateway_holders: usize,
    /// Replica-sync peers together.
    pub peer_holders: usize,
    /// Gateway VMs whose booking watermark is kept: every snapshot echoes
    /// each one, so they are bounded as holders are.
    pub gateway_vms: usize,
}

/// The most `holders` may be: with it, and one holder's bound at
/// `MAX_PROMPT_TOKENS_CEILING` (2^32 decode blocks at most), no rank's sum
/// can reach 2^63.
pub const LEDGER_HOLDERS_CEILING: usize = 1 << 30;

impl Default for LedgerCaps {
    /// A gateway VM or a client of the selection API with 32k requests in
    /// flight, and a fleet's worth from peers, fit; the kinds' caps sum
    /// below the total, so a flood of one kind leaves the others their
    /// room. At about 300 bytes a holder, a full ledger is under 100 MB.
    fn default() -> Self {
        LedgerCaps {
            holders: 262_144,
            holders_per_origin: 32_768,
            gateway_holders: 65_536,
            peer_holders: 131_072,
            gateway_vms: 1024,
        }
    }
}

impl LedgerCaps {
    pub fn validate(&self) -> Result<(), String> {
        for (key, v) in [
            ("holders", self.holders),
            ("holders_per_origin", self.holders_per_origin),
            ("gateway_holders", self.gateway_holders),
            ("peer_holders", self.peer_holders),
            ("gateway_vms", self.gateway_vms),
        ] {
            if !(1..=LEDGER_HOLDERS_CEILING).contains(&v) {
                return Err(format!(
                    "load.caps.{key} must be within [1, {LEDGER_HOLDERS_CEILING}], got {v}"
                ));
            }
        }
        Ok(())
    }
}
