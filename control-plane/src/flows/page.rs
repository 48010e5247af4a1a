//! The flow queries' pages are the crate's one bounded-result type ([`crate::page`]).

pub use crate::page::{MAX_PAGE, Page, PageRequest};
pub(crate) use crate::page::{field, page};
