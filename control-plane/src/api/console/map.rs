//! The map's drawing, pure: edges between groups (a label's values, address groups, other
//! addresses) by decision, laid out in layers — each group one column right of the groups that
//! reach it, so traffic reads left to right — not by a force simulation, so the same flows draw
//! the same map. The page draws it as SVG on the server; no script runs.

use std::collections::{BTreeMap, BTreeSet};

/// The most groups the page draws; beyond it, it asks for a filter.
pub const MAX_GROUPS: usize = 150;

const COLUMN: f64 = 300.0;
const ROW: f64 = 46.0;
const BOX_W: f64 = 200.0;
const BOX_H: f64 = 30.0;
const MARGIN: f64 = 20.0;

/// One aggregated edge: flows from `from` to `to` that got `decision`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Edge {
    pub from: String,
    pub to: String,
    /// `allowed`, `would-block`, `blocked` or `observed`.
    pub decision: &'static str,
    pub connections: i64,
    pub flows: i64,
}

/// Sums edges with the same ends and decision.
pub fn aggregate(edges: impl IntoIterator<Item = Edge>) -> Vec<Edge> {
    let mut sums: BTreeMap<(String, String, &'static str), (i64, i64)> = BTreeMap::new();
    for e in edges {
        let sum = sums.entry((e.from, e.to, e.decision)).or_default();
        sum.0 = sum.0.saturating_add(e.connections);
        sum.1 = sum.1.saturating_add(e.flows);
    }
    sums.into_iter()
        .map(|((from, to, decision), (connections, flows))| Edge { from, to, decision, connections, flows })
        .collect()
}

#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub name: String,
    pub x: f64,
    pub y: f64,
    pub w: f64,
    pub h: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Path {
    pub edge: Edge,
    /// The SVG path (`M … C …`).
    pub d: String,
    pub color: &'static str,
    pub width: f64,
    pub label_x: f64,
    pub label_y: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    pub nodes: Vec<Node>,
    pub paths: Vec<Path>,
    pub width: f64,
    pub height: f64,
}

/// Each group's column: 0 for groups nothing reaches (or only themselves), else one more than
/// the furthest group reaching it, counting each group once on a path (a cycle does not push
/// its groups right forever).
fn columns(groups: &BTreeSet<&str>, edges: &[Edge]) -> BTreeMap<String, usize> {
    let mut column: BTreeMap<String, usize> = groups.iter().map(|g| ((*g).to_owned(), 0)).collect();
    // Relax at most once per group: longest paths in a graph with cycles are bounded this way.
    for _ in 0..groups.len() {
        let mut moved = false;
        for e in edges.iter().filter(|e| e.from != e.to) {
            let next = column[&e.from] + 1;
            if next < groups.len() && column[&e.to] < next {
                column.insert(e.to.clone(), next);
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    column
}

/// The decision's colour: blocked and would-block red, allowed green, observed grey.
pub fn color(decision: &str) -> &'static str {
    match decision {
        "would-block" | "blocked" => "#b42318",
        "allowed" => "#1a7f37",
        _ => "#6e7781",
    }
}

/// A decision's lane among the edges of one pair of groups.
fn decision_rank(decision: &str) -> usize {
    match decision {
        "allowed" => 0,
        "observed" => 1,
        "would-block" => 2,
        _ => 3,
    }
}

/// Lays `edges` out; `None` when they name more than [`MAX_GROUPS`] groups.
pub fn layout(edges: &[Edge]) -> Option<Layout> {
    let groups: BTreeSet<&str> = edges.iter().flat_map(|e| [e.from.as_str(), e.to.as_str()]).collect();
    if groups.len() > MAX_GROUPS {
        return None;
    }
    let column = columns(&groups, edges);
    let mut by_column: BTreeMap<usize, Vec<&str>> = BTreeMap::new();
    for g in &groups {
        by_column.entry(column[*g]).or_default().push(g);
    }
    let mut nodes = Vec::new();
    let mut at: BTreeMap<&str, (f64, f64)> = BTreeMap::new();
    let tallest = by_column.values().map(Vec::len).max().unwrap_or(0);
    for (c, names) in &by_column {
        for (r, name) in names.iter().enumerate() {
            let (x, y) = (MARGIN + *c as f64 * COLUMN, MARGIN + r as f64 * ROW);
            at.insert(name, (x, y));
            nodes.push(Node { name: (*name).to_owned(), x, y, w: BOX_W, h: BOX_H });
        }
    }
    let most = edges.iter().map(|e| e.connections).max().unwrap_or(1).max(1) as f64;
    let paths = edges
        .iter()
        .map(|e| {
            let (fx, fy) = at[e.from.as_str()];
            let (tx, ty) = at[e.to.as_str()];
            // Out of the source's right side, into the destination's left side; an edge to
            // itself or backwards loops out and in on the right.
            // Each decision its own lane, so edges of one pair lie side by side, not on top.
            let lane = (decision_rank(e.decision) as f64 - 1.5) * 6.0;
            let (sx, sy) = (fx + BOX_W, fy + BOX_H / 2.0 + lane);
            let (ex, ey) = (tx, ty + BOX_H / 2.0 + lane);
            let d = if ex > sx {
                let bend = (ex - sx) / 2.0;
                format!("M{sx:.1},{sy:.1} C{:.1},{sy:.1} {:.1},{ey:.1} {ex:.1},{ey:.1}", sx + bend, ex - bend)
            } else {
                let ex = tx + BOX_W;
                format!("M{sx:.1},{sy:.1} C{:.1},{sy:.1} {:.1},{ey:.1} {ex:.1},{ey:.1}", sx + 60.0, ex + 60.0)
            };
            Path {
                d,
                color: color(e.decision),
                width: 1.5 + 4.5 * ((e.connections.max(1) as f64).ln() / most.ln().max(1.0)),
                label_x: if ex > sx { (sx + ex) / 2.0 } else { sx + 50.0 },
                label_y: (sy + ey) / 2.0 - 3.0,
                edge: e.clone(),
            }
        })
        .collect();
    let columns = by_column.len().max(1) as f64;
    Some(Layout {
        nodes,
        paths,
        width: 2.0 * MARGIN + (columns - 1.0) * COLUMN + BOX_W + 80.0,
        height: 2.0 * MARGIN + tallest.max(1) as f64 * ROW,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edge(from: &str, to: &str, decision: &'static str, connections: i64) -> Edge {
        Edge { from: from.into(), to: to.into(), decision, connections, flows: 1 }
    }

    fn column_of(layout: &Layout, name: &str) -> f64 {
        layout.nodes.iter().find(|n| n.name == name).unwrap().x
    }

    #[test]
    fn traffic_reads_left_to_right() {
        let edges = aggregate([
            edge("app=lb", "app=web", "allowed", 5),
            edge("app=web", "app=db", "allowed", 3),
            edge("app=web", "app=db", "allowed", 4),
            edge("app=batch", "app=db", "would-block", 2),
        ]);
        assert_eq!(edges.len(), 3, "the two web → db edges are one: {edges:?}");
        assert_eq!(edges.iter().find(|e| e.from == "app=web").unwrap().connections, 7);
        let layout = layout(&edges).unwrap();
        assert!(column_of(&layout, "app=lb") < column_of(&layout, "app=web"));
        assert!(column_of(&layout, "app=web") < column_of(&layout, "app=db"));
        assert_eq!(column_of(&layout, "app=batch"), column_of(&layout, "app=lb"));
        let blocked = layout.paths.iter().find(|p| p.edge.decision == "would-block").unwrap();
        assert_eq!(blocked.color, "#b42318");
        // The same edges draw the same map.
        assert_eq!(super::layout(&edges).unwrap(), layout);
    }

    #[test]
    fn cycles_and_self_edges_end() {
        let edges = aggregate([
            edge("a", "b", "allowed", 1),
            edge("b", "a", "allowed", 1),
            edge("b", "b", "observed", 1),
        ]);
        let layout = layout(&edges).unwrap();
        assert_eq!(layout.nodes.len(), 2);
        assert!(layout.nodes.iter().all(|n| n.x.is_finite() && n.x < 3.0 * COLUMN));
        assert_eq!(layout.paths.len(), 3);
    }

    #[test]
    fn too_many_groups_draw_nothing() {
        let edges: Vec<Edge> =
            (0..=MAX_GROUPS / 2).map(|i| edge(&format!("s{i}"), &format!("d{i}"), "allowed", 1)).collect();
        assert!(edges.len() * 2 > MAX_GROUPS);
        assert_eq!(layout(&edges), None);
        assert!(layout(&edges[..MAX_GROUPS / 2]).is_some());
    }
}
