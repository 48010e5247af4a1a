//! Address trust (DESIGN §3: nothing an agent says about itself is trusted for authorization).
//! A workload's reported address enters other workloads' peer sets only if it lies in one of
//! the estate's ranges (set by operators), within the ranges the workload's enrolling token
//! narrowed it to (if any), and no other live workload claims it as well — a claimed-twice
//! address is rendered for neither until an operator resolves it. Pure: the publish transaction
//! loads the claims, judges them here, renders only accepted addresses and stores every standing.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use innerwall_wire::identity::WorkloadId;
use innerwall_wire::policy::Cidr;

/// Where a reported address stands. Stored as its code in `workload_addresses.standing`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Standing {
    Accepted,
    OutsideEstate,
    OutsideToken,
    Conflict,
}

impl Standing {
    pub const ALL: [Standing; 4] =
        [Standing::Accepted, Standing::OutsideEstate, Standing::OutsideToken, Standing::Conflict];

    pub fn code(self) -> i16 {
        match self {
            Standing::Accepted => 1,
            Standing::OutsideEstate => 2,
            Standing::OutsideToken => 3,
            Standing::Conflict => 4,
        }
    }

    pub fn from_code(code: i16) -> Option<Standing> {
        Standing::ALL.into_iter().find(|s| s.code() == code)
    }

    /// The name shown by the CLI and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Standing::Accepted => "accepted",
            Standing::OutsideEstate => "outside-estate-ranges",
            Standing::OutsideToken => "outside-token-ranges",
            Standing::Conflict => "conflict",
        }
    }

    /// Why an address is not rendered, and what an operator can do about it.
    pub fn reason(self) -> &'static str {
        match self {
            Standing::Accepted => "rendered into the peer sets that select this workload",
            Standing::OutsideEstate => {
                "not in any estate range; add one with `innerwall estate-range add` if this address is yours"
            }
            Standing::OutsideToken => "not in the address ranges of the token that enrolled this workload",
            Standing::Conflict => {
                "claimed by another live workload as well; rendered for neither until one of them stops \
                 reporting it, is retired or deny-listed, or `innerwall workload release-address` drops a claim"
            }
        }
    }
}

/// What one live workload claims: the addresses it reported and the ranges its enrolling token
/// narrowed it to (empty: the estate ranges alone decide).
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    pub workload: WorkloadId,
    pub addresses: &'a BTreeSet<IpAddr>,
    pub narrowed_to: &'a [Cidr],
}

/// The standing of every claimed address, per workload.
pub type Standings = BTreeMap<WorkloadId, BTreeMap<IpAddr, Standing>>;

/// Judges every claim of the live workloads against the estate ranges, each workload's own
/// narrowing, and each other. Only claims that pass the ranges can conflict: an address a
/// workload may not claim at all cannot take another workload's address away.
pub fn judge<'a>(estate: &[Cidr], claims: impl IntoIterator<Item = Claim<'a>>) -> Standings {
    let mut standings = Standings::new();
    let mut holders: BTreeMap<IpAddr, Vec<WorkloadId>> = BTreeMap::new();
    for claim in claims {
        let judged = standings.entry(claim.workload).or_default();
        for &address in claim.addresses {
            let standing = if !estate.iter().any(|r| r.contains(&address)) {
                Standing::OutsideEstate
            } else if !claim.narrowed_to.is_empty() && !claim.narrowed_to.iter().any(|r| r.contains(&address))
            {
                Standing::OutsideToken
            } else {
                holders.entry(address).or_default().push(claim.workload);
                Standing::Accepted
            };
            judged.insert(address, standing);
        }
    }
    for (address, workloads) in holders {
        if workloads.len() > 1 {
            for w in workloads {
                standings.entry(w).or_default().insert(address, Standing::Conflict);
            }
        }
    }
    standings
}

/// The addresses some workload of `standings` holds: claimed inside the ranges, so another
/// claim of it conflicts (accepted, or in conflict already).
pub fn held(standings: &Standings) -> impl Iterator<Item = IpAddr> + '_ {
    standings
        .values()
        .flatten()
        .filter(|(_, s)| matches!(s, Standing::Accepted | Standing::Conflict))
        .map(|(a, _)| *a)
}

/// The workloads that claim each conflicting address.
pub fn conflicts(standings: &Standings) -> BTreeMap<IpAddr, BTreeSet<WorkloadId>> {
    let mut out: BTreeMap<IpAddr, BTreeSet<WorkloadId>> = BTreeMap::new();
    for (w, judged) in standings {
        for (a, s) in judged {
            if *s == Standing::Conflict {
                out.entry(*a).or_default().insert(*w);
            }
        }
    }
    out
}

/// The addresses of `workload` that may be rendered.
pub fn accepted(standings: &Standings, workload: WorkloadId) -> BTreeSet<IpAddr> {
    standings
        .get(&workload)
        .into_iter()
        .flatten()
        .filter(|(_, s)| **s == Standing::Accepted)
        .map(|(a, _)| *a)
        .collect()
}

/// The standings that differ from the stored ones (`None`: never judged), in a stable order.
pub fn changes(
    stored: &BTreeMap<(WorkloadId, IpAddr), Option<Standing>>,
    standings: &Standings,
) -> Vec<(WorkloadId, IpAddr, Standing)> {
    standings
        .iter()
        .flat_map(|(w, judged)| judged.iter().map(move |(a, s)| (*w, *a, *s)))
        .filter(|(w, a, s)| stored.get(&(*w, *a)).copied().flatten() != Some(*s))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wid(n: u128) -> WorkloadId {
        WorkloadId::from_uuid(uuid::Uuid::from_u128(0x1000 + n)).unwrap()
    }

    fn set(addrs: &[&str]) -> BTreeSet<IpAddr> {
        addrs.iter().map(|a| a.parse().unwrap()).collect()
    }

    fn cidrs(texts: &[&str]) -> Vec<Cidr> {
        texts.iter().map(|t| Cidr::parse(t).unwrap()).collect()
    }

    fn standing(s: &Standings, w: u128, a: &str) -> Standing {
        s[&wid(w)][&a.parse::<IpAddr>().unwrap()]
    }

    #[test]
    fn only_estate_addresses_within_the_token_ranges_are_accepted() {
        let estate = cidrs(&["10.0.0.0/8", "fd00::/8"]);
        let web = set(&["10.1.0.9", "8.8.8.8", "fd00::9", "2001:db8::9"]);
        let narrowed = set(&["10.2.0.1", "10.3.0.1"]);
        let token = cidrs(&["10.2.0.0/16"]);
        let s = judge(
            &estate,
            [
                Claim { workload: wid(1), addresses: &web, narrowed_to: &[] },
                Claim { workload: wid(2), addresses: &narrowed, narrowed_to: &token },
            ],
        );
        assert_eq!(standing(&s, 1, "10.1.0.9"), Standing::Accepted);
        assert_eq!(standing(&s, 1, "fd00::9"), Standing::Accepted);
        assert_eq!(standing(&s, 1, "8.8.8.8"), Standing::OutsideEstate);
        assert_eq!(standing(&s, 1, "2001:db8::9"), Standing::OutsideEstate);
        assert_eq!(standing(&s, 2, "10.2.0.1"), Standing::Accepted);
        assert_eq!(standing(&s, 2, "10.3.0.1"), Standing::OutsideToken);
        assert_eq!(accepted(&s, wid(1)), set(&["10.1.0.9", "fd00::9"]));
        assert_eq!(accepted(&s, wid(2)), set(&["10.2.0.1"]));
        assert!(conflicts(&s).is_empty());
    }

    #[test]
    fn an_address_claimed_twice_is_accepted_for_neither() {
        let estate = cidrs(&["10.0.0.0/8"]);
        let (a, b, c) = (set(&["10.0.0.5", "10.0.0.6"]), set(&["10.0.0.5"]), set(&["10.0.0.5"]));
        let token = cidrs(&["10.9.0.0/16"]);
        let s = judge(
            &estate,
            [
                Claim { workload: wid(1), addresses: &a, narrowed_to: &[] },
                Claim { workload: wid(2), addresses: &b, narrowed_to: &[] },
                // Its token does not allow 10.0.0.5: its claim is refused, not a third claimant.
                Claim { workload: wid(3), addresses: &c, narrowed_to: &token },
            ],
        );
        assert_eq!(standing(&s, 1, "10.0.0.5"), Standing::Conflict);
        assert_eq!(standing(&s, 2, "10.0.0.5"), Standing::Conflict);
        assert_eq!(standing(&s, 3, "10.0.0.5"), Standing::OutsideToken);
        assert_eq!(accepted(&s, wid(1)), set(&["10.0.0.6"]));
        assert!(accepted(&s, wid(2)).is_empty());
        assert_eq!(
            conflicts(&s),
            BTreeMap::from([("10.0.0.5".parse().unwrap(), BTreeSet::from([wid(1), wid(2)]))])
        );
    }

    #[test]
    fn only_changed_standings_are_written() {
        let estate = cidrs(&["10.0.0.0/8"]);
        let claimed = set(&["10.0.0.5", "10.0.0.6", "8.8.8.8"]);
        let s = judge(&estate, [Claim { workload: wid(1), addresses: &claimed, narrowed_to: &[] }]);
        let ip = |a: &str| a.parse::<IpAddr>().unwrap();
        let stored = BTreeMap::from([
            ((wid(1), ip("10.0.0.5")), Some(Standing::Accepted)),
            ((wid(1), ip("10.0.0.6")), Some(Standing::Conflict)),
            ((wid(1), ip("8.8.8.8")), None),
        ]);
        assert_eq!(
            changes(&stored, &s),
            [(wid(1), ip("8.8.8.8"), Standing::OutsideEstate), (wid(1), ip("10.0.0.6"), Standing::Accepted)]
        );
    }

    proptest::proptest! {
        /// The rule that lets an enrollment judge its new workloads among themselves
        /// (`inputs::enroll`): when no address the new ones hold is held by the others, judging
        /// the two groups apart gives what judging them together does.
        #[test]
        fn claims_apart_judge_alone(
            claims in proptest::collection::vec(
                (proptest::collection::btree_set(0u8..12, 0..4), proptest::option::of(0u8..3)),
                1..12,
            ),
            split in 0usize..12,
        ) {
            // Addresses 10.0.0.0-7 are in the estate, 10.0.0.8-11 not; a token allows one
            // quarter of the first eight, or everything.
            let estate = cidrs(&["10.0.0.0/29"]);
            let tokens = [cidrs(&["10.0.0.0/30"]), cidrs(&["10.0.0.4/31"]), cidrs(&["10.0.0.6/31"])];
            let addresses: Vec<BTreeSet<IpAddr>> = claims
                .iter()
                .map(|(a, _)| a.iter().map(|n| IpAddr::from([10, 0, 0, *n])).collect())
                .collect();
            let claim = |i: usize| Claim {
                workload: wid(i as u128),
                addresses: &addresses[i],
                narrowed_to: claims[i].1.map_or(&[][..], |t| &tokens[usize::from(t)][..]),
            };
            let split = split.min(claims.len());
            let old = judge(&estate, (0..split).map(claim));
            let new = judge(&estate, (split..claims.len()).map(claim));
            let held_new: BTreeSet<IpAddr> = held(&new).collect();
            if !held(&old).any(|a| held_new.contains(&a)) {
                let mut apart = old;
                apart.extend(new);
                proptest::prop_assert_eq!(apart, judge(&estate, (0..claims.len()).map(claim)));
            }
        }
    }

    #[test]
    fn no_estate_range_accepts_nothing() {
        let s = judge(&[], [Claim { workload: wid(1), addresses: &set(&["10.0.0.5"]), narrowed_to: &[] }]);
        assert_eq!(standing(&s, 1, "10.0.0.5"), Standing::OutsideEstate);
    }

    #[test]
    fn codes_round_trip() {
        for s in Standing::ALL {
            assert_eq!(Standing::from_code(s.code()), Some(s));
        }
        assert_eq!(Standing::from_code(0), None);
        assert_eq!(Standing::from_code(5), None);
    }
}
