//! Who holds how much of the ledger, kept as holders come and go, so that
//! the caps are checked and the gauges read without a scan.

use super::{Holder, Id, Origin};
use crate::config::LedgerCaps;
use std::collections::HashMap;

/// The unit the per-origin cap counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Owner {
    /// One of this sidecar's Envoy VMs, by the tag it chose.
    Vm(u64),
    /// The selection API.
    Api,
    /// A replica-sync peer, by the process id it announced.
    Peer(u64),
}

impl Owner {
    fn of(h: &Holder) -> Owner {
        match (&h.origin, &h.id) {
            (Origin::Peer(p), _) => Owner::Peer(*p),
            (Origin::Here, Id::Gateway(k)) => Owner::Vm(k.vm),
            (Origin::Here, Id::Reservation(_)) => Owner::Api,
        }
    }
}

/// Which cap refused a holder, and its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Full {
    #[error("its origin already holds load.caps.holders_per_origin ({0}) holders")]
    Origin(usize),
    #[error("this sidecar's gateways already hold load.caps.gateway_holders ({0}) holders")]
    Gateways(usize),
    #[error("replica-sync peers already hold load.caps.peer_holders ({0}) holders")]
    Peers(usize),
    #[error("the ledger already holds load.caps.holders ({0}) holders")]
    Total(usize),
    #[error("load.caps.gateway_vms ({0}) gateway VMs are already tracked")]
    GatewayVms(usize),
}

impl Full {
    /// A bit per cap, for logging each cap's first refusal once.
    pub(super) fn bit(&self) -> u8 {
        match self {
            Full::Origin(_) => 1,
            Full::Gateways(_) => 2,
            Full::Peers(_) => 4,
            Full::Total(_) => 8,
            Full::GatewayVms(_) => 16,
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Census {
    per_owner: HashMap<Owner, usize>,
    gateways: usize,
    api: usize,
    peers: usize,
}

impl Census {
    /// Whether one more holder like `h` fits, with `total` held now.
    pub fn room(&self, h: &Holder, total: usize, caps: &LedgerCaps) -> Result<(), Full> {
        let owner = Owner::of(h);
        if self.per_owner.get(&owner).copied().unwrap_or(0) >= caps.holders_per_origin {
            return Err(Full::Origin(caps.holders_per_origin));
        }
        match owner {
            Owner::Vm(_) if self.gateways >= caps.gateway_holders => {
                return Err(Full::Gateways(caps.gateway_holders));
            }
            Owner::Peer(_) if self.peers >= caps.peer_holders => {
                return Err(Full::Peers(caps.peer_holders));
            }
            _ => {}
        }
        if total >= caps.holders {
            return Err(Full::Total(caps.holders));
        }
        Ok(())
    }

    pub fn add(&mut self, h: &Holder) {
        let owner = Owner::of(h);
        *self.per_owner.entry(owner).or_default() += 1;
        *self.kind(owner) += 1;
    }

    pub fn remove(&mut self, h: &Holder) {
        let owner = Owner::of(h);
        if let Some(n) = self.per_owner.get_mut(&owner) {
            *n -= 1;
            if *n == 0 {
                self.per_owner.remove(&owner);
            }
        }
        let k = self.kind(owner);
        *k = k.saturating_sub(1);
    }

    fn kind(&mut self, owner: Owner) -> &mut usize {
        match owner {
            Owner::Vm(_) => &mut self.gateways,
            Owner::Api => &mut self.api,
            Owner::Peer(_) => &mut self.peers,
        }
    }

    /// Holders by kind: (gateway here, reservations here, from peers).
    pub fn counts(&self) -> (usize, usize, usize) {
        (self.gateways, self.api, self.peers)
    }

    /// Gives back what a surge of origins left behind; the entries moved,
    /// if it did.
    pub fn shrink(&mut self) -> Option<usize> {
        super::shrink_map(&mut self.per_owner)
    }
}
