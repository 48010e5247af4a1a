// Innerwall console: the one script. Every page works without it; it only refreshes tables
// that say where their rows come from (`data-refresh`), every 5 s while the page is visible.
"use strict";
(function () {
  const PERIOD_MS = 5000;
  for (const body of document.querySelectorAll("tbody[data-refresh]")) {
    const url = body.getAttribute("data-refresh");
    if (!url || !url.startsWith("/")) continue;
    const refresh = async () => {
      if (document.visibilityState !== "visible") return;
      try {
        const answer = await fetch(url, { credentials: "same-origin", headers: { "Accept": "text/html" } });
        if (answer.ok && answer.headers.get("content-type")?.startsWith("text/html")) {
          body.innerHTML = await answer.text();
          body.dispatchEvent(new CustomEvent("refreshed"));
        }
      } catch (_) {
        // Offline for a moment: the rows stay as they were; the next tick tries again.
      }
    };
    setInterval(refresh, PERIOD_MS);
  }
})();
