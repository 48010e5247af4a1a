//! Workload identity: the one URI SAN a workload certificate carries (IDN-3).
//!
//! Only the canonical form `innerwall://workload/<uuid>` (lower-case, hyphenated, not nil) is
//! accepted, so two spellings can never name the same workload.

use std::fmt;
use std::str::FromStr;

use uuid::Uuid;

/// The scheme and path prefix of every workload URI.
pub const WORKLOAD_URI_PREFIX: &str = "innerwall://workload/";

/// A workload's identity, assigned by the control plane at enrollment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkloadId(Uuid);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("workload uri {uri:?} must start with {WORKLOAD_URI_PREFIX:?}")]
    Prefix { uri: String },
    #[error(
        "workload uri {uri:?} must end in a lower-case hyphenated uuid \
         (e.g. {WORKLOAD_URI_PREFIX}0b7f4c1e-9a43-4d2b-8f0e-5c1d2e3f4a5b) and nothing after it"
    )]
    Uuid { uri: String },
    #[error("workload uri {uri:?} names the nil uuid, which is never assigned")]
    Nil { uri: String },
}

impl WorkloadId {
    /// A fresh random identity (enrollment only).
    pub fn new_random() -> Self {
        Self(Uuid::new_v4())
    }

    /// Wraps an assigned uuid; `None` for the nil uuid.
    pub fn from_uuid(uuid: Uuid) -> Option<Self> {
        (!uuid.is_nil()).then_some(Self(uuid))
    }

    pub fn uuid(&self) -> Uuid {
        self.0
    }

    /// The URI SAN for this identity.
    pub fn to_uri(&self) -> String {
        format!("{WORKLOAD_URI_PREFIX}{}", self.0.hyphenated())
    }

    /// Parses a URI SAN, accepting only the canonical form.
    pub fn parse_uri(uri: &str) -> Result<Self, IdentityError> {
        let Some(rest) = uri.strip_prefix(WORKLOAD_URI_PREFIX) else {
            return Err(IdentityError::Prefix { uri: uri.to_owned() });
        };
        let uuid = Uuid::try_parse(rest).map_err(|_| IdentityError::Uuid { uri: uri.to_owned() })?;
        // `try_parse` also takes simple, braced, urn and upper-case forms; only one spelling is ours.
        if uuid.hyphenated().to_string() != rest {
            return Err(IdentityError::Uuid { uri: uri.to_owned() });
        }
        Self::from_uuid(uuid).ok_or_else(|| IdentityError::Nil { uri: uri.to_owned() })
    }
}

impl fmt::Display for WorkloadId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.hyphenated())
    }
}

impl FromStr for WorkloadId {
    type Err = IdentityError;

    /// Parses the bare uuid an operator types (`innerwall workload retire <ID>`), canonical form only.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse_uri(&format!("{WORKLOAD_URI_PREFIX}{s}"))
    }
}

/// What an agent reports about its host, at enrollment and on its stream (Hello, inventory).
/// The texts are as the host gave them; whoever stores one bounds it, and addresses are parsed
/// where they are used (`routable_addresses` in the control plane).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostFacts {
    pub hostname: String,
    pub os: Option<OsInfo>,
    pub interfaces: Vec<NetworkInterface>,
    /// `/etc/machine-id`: the same identity seen with two machine ids is a cloned host (IDN-7).
    pub machine_id: String,
    /// The kernel's boot id, to tell a reboot from a clone.
    pub boot_id: String,
    /// The local range the kernel picks ephemeral ports from, when known and valid.
    pub ephemeral_ports: Option<crate::policy::PortRange>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OsInfo {
    pub family: String,
    pub name: String,
    pub version: String,
    pub kernel_version: String,
    pub architecture: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NetworkInterface {
    pub name: String,
    /// In CIDR notation as the kernel lists them (`10.0.0.5/24`).
    pub addresses: Vec<String>,
    pub mac_address: String,
}

/// The agent's build and what it can do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentInfo {
    pub version: String,
    /// Opaque feature strings, e.g. `nftables`, `ebpf-flows`.
    pub capabilities: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0b7f4c1e-9a43-4d2b-8f0e-5c1d2e3f4a5b";

    fn check(uri: &str, ok: bool) {
        let parsed = WorkloadId::parse_uri(uri);
        assert_eq!(parsed.is_ok(), ok, "{uri:?} → {parsed:?}");
        if let Ok(id) = parsed {
            assert_eq!(id.to_uri(), uri, "round trip must be byte-identical");
        }
    }

    #[test]
    fn workload_uri_accepts_only_canonical_form() {
        check(&format!("innerwall://workload/{ID}"), true);
        let hostile = [
            String::new(),
            "innerwall://workload/".into(),
            format!("INNERWALL://workload/{ID}"),
            format!("Innerwall://workload/{ID}"),
            format!("innerwall://Workload/{ID}"),
            format!("innerwall://workload/{ID}/"),
            format!("innerwall://workload/{ID}/extra"),
            format!("innerwall://workload/{ID}?x=1"),
            format!("innerwall://workload/{ID}#f"),
            format!("innerwall://workload//{ID}"),
            format!("innerwall:/workload/{ID}"),
            format!("innerwall://workloads/{ID}"),
            format!("spiffe://workload/{ID}"),
            format!(" innerwall://workload/{ID}"),
            format!("innerwall://workload/{ID} "),
            format!("innerwall://workload/{}", ID.to_uppercase()),
            format!("innerwall://workload/{}", ID.replace('-', "")),
            format!("innerwall://workload/{{{ID}}}"),
            format!("innerwall://workload/urn:uuid:{ID}"),
            "innerwall://workload/0b7f4c1e-9a43-4d2b-8f0e-5c1d2e3f4a5".into(),
            "innerwall://workload/0b7f4c1e-9a43-4d2b-8f0e-5c1d2e3f4a5bb".into(),
            "innerwall://workload/0b7f4c1e-9a43-4d2b-8f0e-5c1d2e3f4a5g".into(),
            "innerwall://workload/00000000-0000-0000-0000-000000000000".into(),
            format!("innerwall://workload/{}", ID.replace('a', "а")), // Cyrillic a
            format!("innerwall://workload/{ID}\u{0}"),
        ];
        for uri in hostile {
            check(&uri, false);
        }
    }

    #[test]
    fn workload_uri_errors_say_what_is_wrong() {
        let e = WorkloadId::parse_uri("https://workload/x").unwrap_err();
        assert!(e.to_string().contains("must start with \"innerwall://workload/\""), "{e}");
        let e = WorkloadId::parse_uri(&format!("innerwall://workload/{ID}/")).unwrap_err();
        assert!(matches!(e, IdentityError::Uuid { .. }), "{e}");
        let nil = "innerwall://workload/00000000-0000-0000-0000-000000000000";
        assert!(matches!(WorkloadId::parse_uri(nil), Err(IdentityError::Nil { .. })));
    }

    #[test]
    fn workload_uri_round_trips_random_ids_and_bare_form() {
        for _ in 0..100 {
            let id = WorkloadId::new_random();
            assert_eq!(WorkloadId::parse_uri(&id.to_uri()), Ok(id));
            assert_eq!(id.to_string().parse::<WorkloadId>(), Ok(id));
        }
        assert!(ID.to_uppercase().parse::<WorkloadId>().is_err());
    }
}
