//! Who is calling: the `Authorization: Bearer iwo_…` header, bounded in size, checked by
//! `identity::operators::authenticate`, and the token's role compared with what the route needs
//! (401 and 403 as problem documents). The caller reaches handlers as a request extension, which
//! only [`authorize`] inserts.

use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::Response;

use super::ApiState;
use super::edge::Peer;
use super::problem::ApiError;
use crate::identity::operators::{self, Operator, Role};

/// The longest `Authorization` header read; a token is 55 characters.
pub const MAX_AUTHORIZATION: usize = 256;

/// The bearer token of a request, or why there is none.
fn bearer(headers: &HeaderMap) -> Result<&str, ApiError> {
    let mut values = headers.get_all(AUTHORIZATION).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(ApiError::NoToken(
            "this needs an operator token: send one Authorization: Bearer iwo_… header \
             (mint a token with `innerwall operator token mint`)",
        ));
    };
    if value.len() > MAX_AUTHORIZATION {
        return Err(ApiError::NoToken("the Authorization header is longer than any operator token"));
    }
    let text = value.to_str().map_err(|_| ApiError::NoToken("the Authorization header is not ASCII"))?;
    match text.split_once(' ') {
        Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => Ok(token.trim()),
        _ => Err(ApiError::NoToken("the Authorization header must be `Bearer iwo_…`")),
    }
}

/// Middleware of every route that needs a role: authenticates the caller, checks the role and
/// hands the [`Operator`] on as an extension. A source that used its share of requests without
/// a valid token is refused before its token is looked up — unless the token authenticated on
/// this replica lately (it is still authenticated now), so that requests without a valid token
/// from an operator's address (a shared NAT) cannot lock that operator out. A valid token's
/// requests are counted against its rate and its requests in flight (`api::edge`).
pub async fn authorize(
    State((state, needed)): State<(ApiState, Role)>,
    mut request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let peer = request.extensions().get::<Peer>().copied();
    let token = bearer(request.headers()).map(str::to_owned);
    if let Err(refused) = state.edge.check_source(peer)
        && !token.as_deref().is_ok_and(|t| state.edge.vouched(t))
    {
        return Err(refused);
    }
    let token = match token {
        Ok(token) => token,
        Err(e) => {
            state.edge.admit_unauthenticated(peer)?;
            return Err(e);
        }
    };
    let operator = match operators::authenticate(&state.pool, &token).await {
        Ok(operator) => operator,
        Err(refused @ operators::Refused::Unavailable(_)) => return Err(refused.into()),
        Err(refused) => {
            state.edge.admit_unauthenticated(peer)?;
            return Err(refused.into());
        }
    };
    state.edge.vouch(&token);
    let _in_flight = state.edge.admit_token(&operator.token_id)?;
    if !operator.role.allows(needed) {
        return Err(ApiError::Forbidden { needed, has: operator.role, token: operator.token_id });
    }
    request.extensions_mut().insert(operator);
    Ok(next.run(request).await)
}

/// Middleware of the routes that need no token (the OpenAPI document): counted against the
/// source's share of requests without a valid token.
pub async fn unauthenticated(
    State(state): State<ApiState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    state.edge.admit_unauthenticated(request.extensions().get::<Peer>().copied())?;
    Ok(next.run(request).await)
}

/// The caller of a route mounted with a role, for handlers (`Extension<Operator>` by another
/// name, refused as an internal error if a route was mounted without [`authorize`]).
#[derive(Debug, Clone)]
pub struct Caller(pub Operator);

impl Caller {
    pub fn actor(&self) -> String {
        self.0.actor()
    }
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, _: &S) -> Result<Self, ApiError> {
        parts.extensions.get::<Operator>().cloned().map(Caller).ok_or_else(|| {
            ApiError::Domain(crate::error::Error::Corrupt {
                what: "api route",
                detail: "mounted without a role, so no caller is known".into(),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    #[test]
    fn bearer_reads_one_bounded_header() {
        let with = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            }
            h
        };
        assert_eq!(bearer(&with(&["Bearer iwo_x"])).unwrap(), "iwo_x");
        assert_eq!(bearer(&with(&["bearer  iwo_x "])).unwrap(), "iwo_x");
        for bad in [&[][..], &["Basic abc"], &["Bearer"], &["Bearer a", "Bearer b"]] {
            assert!(matches!(bearer(&with(bad)), Err(ApiError::NoToken(_))), "{bad:?}");
        }
        let long = format!("Bearer {}", "a".repeat(MAX_AUTHORIZATION));
        assert!(matches!(bearer(&with(&[&long])), Err(ApiError::NoToken(_))));
    }
}
