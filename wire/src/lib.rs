//! The Innerwall agent contract: generated protobuf types and services, the rendered-policy
//! domain model with the one diff/apply implementation (SYNC-1), the flow evidence vocabulary
//! with the one flow decision (FLOW-1..3), and the identity and label grammar (IDN-3, IDN-6); and the little both binaries' processes share
//! (shutdown tasks, backoff, configuration files). Both the control plane and the agent link this crate; it depends on
//! nothing else in the workspace.

/// Gives a fieldless enum its `ALL`, `name()`, `Display` and `FromStr` from one table of
/// names, so the spelling operators read and type is written once per variant.
macro_rules! named_enum {
    ($ty:ident, $what:literal, { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            pub const ALL: [$ty; [$($name),+].len()] = [$($ty::$variant),+];

            /// The name operators read and type.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl std::str::FromStr for $ty {
            type Err = $crate::policy::PolicyError;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                $ty::ALL
                    .into_iter()
                    .find(|v| v.name() == s)
                    .ok_or_else(|| $crate::policy::PolicyError::UnknownName { what: $what, text: s.to_owned() })
            }
        }
    };
}

pub mod backoff;
pub mod codec;
pub mod config;
pub mod convert;
pub mod flows;
pub mod identity;
pub mod labels;
pub mod policy;
pub mod secret;
pub mod sync;
pub mod tasks;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

/// Generated code for the `innerwall.agent.v1` package. Domain code converts at the boundary
/// (`convert`) and never matches on these types directly.
pub mod proto {
    #![allow(missing_debug_implementations, unused_qualifications, clippy::all)]
    tonic::include_proto!("innerwall.agent.v1");
}

/// The protobuf package of the contract; a breaking change gets a new `vN`.
pub const CONTRACT_PACKAGE: &str = "innerwall.agent.v1";
