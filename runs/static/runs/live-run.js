// A run's page while the run is in flight: fetch the live fragment every few seconds and swap
// it in; stop once the fragment says the run has settled (or the run page is gone).
(function () {
  "use strict";
  const panel = document.getElementById("run-live");
  if (!panel || panel.dataset.inFlight !== "true") return;
  const every = Number(panel.dataset.every) || 1500;

  async function poll() {
    let fresh = null;
    try {
      const response = await fetch(panel.dataset.url, { credentials: "same-origin" });
      if (response.status === 404 || response.status === 403) return stop();
      if (response.ok) {
        const holder = document.createElement("div");
        holder.innerHTML = await response.text();
        fresh = holder.querySelector("#run-live");
      }
    } catch (error) {
      // The server is restarting or the network hiccuped: try again at the next tick.
    }
    if (fresh) {
      // A fold the reader opened stays open across the swap.
      const opened = new Set([...panel.querySelectorAll("details[open]")].map((fold) => fold.id));
      panel.replaceChildren(...fresh.childNodes);
      opened.forEach((id) => { const fold = document.getElementById(id); if (fold) fold.open = true; });
      panel.dataset.inFlight = fresh.dataset.inFlight;
      panel.dataset.updates = String(Number(panel.dataset.updates || 0) + 1);
      if (fresh.dataset.inFlight !== "true") return stop();
    }
    setTimeout(poll, every);
  }

  function stop() {
    panel.dataset.polling = "stopped";
  }

  panel.dataset.polling = "on";
  setTimeout(poll, every);
})();
