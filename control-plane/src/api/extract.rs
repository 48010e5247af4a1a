//! What handlers take from a request, each bounded and refused as a problem document: a JSON
//! body (`application/json`, at most the listener's `max_body` bytes, read within the request
//! timeout), a query, path parameters, and the `If-Match` precondition; and the `ETag` a
//! versioned answer carries.

use axum::body::Body;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE, ETAG, IF_MATCH};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue};
use serde::de::DeserializeOwned;

use super::ApiState;
use super::problem::ApiError;

/// The body limit in force, put in every request's extensions by the router.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);

/// A JSON body, refused with 415 unless `application/json`, 413 over the limit (by its
/// `Content-Length` before reading, or while reading a chunked one), 400 if it does not parse
/// (unknown fields included where the type denies them).
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned> FromRequest<ApiState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request<Body>, state: &ApiState) -> Result<Self, ApiError> {
        let limit = request.extensions().get::<BodyLimit>().map_or(state.limits.max_body, |l| l.0);
        let content_type = request.headers().get(CONTENT_TYPE).map(|v| v.to_str().unwrap_or("?").to_owned());
        match content_type.as_deref().map(|t| t.split(';').next().unwrap_or("").trim().to_ascii_lowercase()) {
            Some(t) if t == "application/json" => {}
            _ => {
                return Err(ApiError::UnsupportedMediaType(content_type.unwrap_or_else(|| "nothing".into())));
            }
        }
        let (_, bytes) = read_body(request, limit).await?;
        serde_json::from_slice(&bytes).map(JsonBody).map_err(|e| {
            ApiError::Malformed(format!("the request body is not what this operation takes: {e}"))
        })
    }
}

/// The request's body read into memory: 413 over `limit` (by its `Content-Length` before
/// reading, or while reading a chunked one), 400 if it cannot be read. The router reads every
/// body before anything answers, so a request refused early (403, 428, …) is answered after its
/// client finished writing, not cut off with a broken pipe.
pub async fn read_body(request: Request<Body>, limit: usize) -> Result<(Parts, axum::body::Bytes), ApiError> {
    let declared = request.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::PayloadTooLarge { limit });
    }
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, limit).await.map_err(|e| body_error(&e, limit))?;
    Ok((parts, bytes))
}

fn body_error(e: &axum::Error, limit: usize) -> ApiError {
    let too_large = std::iter::successors(Some(e as &(dyn std::error::Error + 'static)), |e| e.source())
        .any(|e| e.is::<http_body_util::LengthLimitError>());
    if too_large {
        ApiError::PayloadTooLarge { limit }
    } else {
        ApiError::Malformed(format!("the request body could not be read: {e}"))
    }
}

/// The longest query string a request may carry, in bytes (a rollup's 1,000 workload ids fit).
pub const MAX_QUERY: usize = 64 * 1024;
/// The longest path parameter (an id, a name, an address, a prefix), in bytes.
pub const MAX_PATH_PARAM: usize = 256;

/// A parameter's name as a refusal shows it: at most 64 characters, escaped.
fn shown(name: &str) -> String {
    name.chars().take(64).flat_map(char::escape_default).collect()
}

/// The checks every query string passes before any handler sees it: at most [`MAX_QUERY`]
/// bytes, and no name or value with a control character (NUL included, which Postgres refuses).
pub fn check_query(query: Option<&str>) -> Result<(), ApiError> {
    let Some(query) = query else { return Ok(()) };
    if query.len() > MAX_QUERY {
        return Err(ApiError::Malformed(format!(
            "the query string is {} bytes; at most {MAX_QUERY} are accepted",
            query.len()
        )));
    }
    let pairs: Vec<(String, String)> = axum::extract::Query::try_from_uri(
        &format!("/?{query}")
            .parse::<axum::http::Uri>()
            .map_err(|e| ApiError::Malformed(format!("the query string: {e}")))?,
    )
    .map(|q: axum::extract::Query<Vec<(String, String)>>| q.0)
    .map_err(|e| ApiError::Malformed(format!("the query string: {}", e.body_text())))?;
    for (name, value) in &pairs {
        crate::input::text("a query parameter's name", name, MAX_QUERY)?;
        crate::input::text(&format!("query parameter {}", shown(name)), value, MAX_QUERY)?;
    }
    Ok(())
}

/// `T` from the query string of `uri`, after [`check_query`]; refused with 400 when it does
/// not parse. Pure: what the [`Query`] extractor runs, and what the `api_params` fuzz target
/// drives.
pub fn query_of<T: DeserializeOwned>(uri: &axum::http::Uri) -> Result<T, ApiError> {
    check_query(uri.query())?;
    axum::extract::Query::<T>::try_from_uri(uri)
        .map(|q| q.0)
        .map_err(|e| ApiError::Malformed(format!("the query string: {}", e.body_text())))
}

/// A query string, refused with 400 when it is too long, holds a control character or does
/// not parse.
#[derive(Debug)]
pub struct Query<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        query_of(&parts.uri).map(Query)
    }
}

/// One path parameter (already percent-decoded): at most [`MAX_PATH_PARAM`] bytes, no control
/// character.
pub fn check_path_param(name: &str, value: &str) -> Result<(), ApiError> {
    if value.len() > MAX_PATH_PARAM {
        return Err(ApiError::Malformed(format!(
            "path parameter {}: {} bytes; at most {MAX_PATH_PARAM} are accepted",
            shown(name),
            value.len()
        )));
    }
    Ok(crate::input::text(&format!("path parameter {}", shown(name)), value, MAX_PATH_PARAM)?)
}

/// Path parameters, each checked by [`check_path_param`], refused with 400 when one does not
/// parse (a malformed workload id, …).
#[derive(Debug)]
pub struct Path<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let raw = axum::extract::RawPathParams::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::Malformed(format!("the path: {}", e.body_text())))?;
        for (name, value) in &raw {
            check_path_param(name, value)?;
        }
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| Path(p.0))
            .map_err(|e| ApiError::Malformed(format!("the path: {}", e.body_text())))
    }
}

/// The version a conditional write is conditioned on: `If-Match: "<version>"` as the `ETag`
/// read gave it. Missing (or `*`) is 428; a weak or unparsable tag is 400, since no version of
/// ours is spelled so.
pub fn if_match(headers: &HeaderMap, what: &str) -> Result<i64, ApiError> {
    let values: Vec<&HeaderValue> = headers.get_all(IF_MATCH).iter().collect();
    let value = match values[..] {
        [] => {
            return Err(ApiError::PreconditionRequired(format!(
                "changing {what} is a conditional write: send If-Match with the ETag of the version you read"
            )));
        }
        [one] => one.to_str().unwrap_or("").trim(),
        _ => return Err(ApiError::Malformed("send one If-Match header, with one ETag".into())),
    };
    if value == "*" {
        return Err(ApiError::PreconditionRequired(format!(
            "If-Match: * names no version; send the ETag of the version of {what} you read"
        )));
    }
    let tag = value.strip_prefix('"').and_then(|v| v.strip_suffix('"')).unwrap_or(value);
    match tag.parse::<i64>() {
        Ok(version) if version >= 0 && !tag.starts_with('+') => Ok(version),
        _ => Err(ApiError::Malformed(format!(
            "If-Match {:?} is not an ETag of this API (a version in quotes, e.g. \"3\"; weak tags never match)",
            value.chars().take(64).collect::<String>()
        ))),
    }
}

/// The `ETag` header of a versioned object.
pub fn etag(version: i64) -> (axum::http::HeaderName, HeaderValue) {
    (ETAG, HeaderValue::from_str(&format!("\"{version}\"")).expect("digits and quotes are a header value"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(IF_MATCH, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn if_match_reads_our_etags_only() {
        assert_eq!(if_match(&headers(&["\"3\""]), "x").unwrap(), 3);
        assert_eq!(if_match(&headers(&[" \"12\" "]), "x").unwrap(), 12);
        assert_eq!(if_match(&headers(&["7"]), "x").unwrap(), 7);
        assert!(matches!(if_match(&headers(&[]), "x"), Err(ApiError::PreconditionRequired(_))));
        assert!(matches!(if_match(&headers(&["*"]), "x"), Err(ApiError::PreconditionRequired(_))));
        for bad in ["W/\"3\"", "\"-1\"", "\"x\"", "\"+3\"", "\"\""] {
            assert!(matches!(if_match(&headers(&[bad]), "x"), Err(ApiError::Malformed(_))), "{bad}");
        }
        assert!(matches!(if_match(&headers(&["\"1\"", "\"2\""]), "x"), Err(ApiError::Malformed(_))));
        assert_eq!(etag(4).1, "\"4\"");
    }
}
