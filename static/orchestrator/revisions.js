/* The task page's revision buttons ("Edit params & resume", "Roll back to vN") apply to a
 * paused task only: hide them (never create them) once live.js reports another status on
 * the task header, and show them again if the task is paused again. Separate from live.js,
 * which it only observes (the header's data-status attribute). */
(function () {
  "use strict";

  function init() {
    var header = document.querySelector('[data-testid="task-header"][data-live-task]');
    if (!header) return;
    function update() {
      var paused = header.getAttribute("data-status") === "paused";
      Array.prototype.forEach.call(document.querySelectorAll("[data-paused-only]"), function (node) {
        node.hidden = !paused;
        node.style.display = paused ? "" : "none";
      });
    }
    new MutationObserver(update).observe(header, { attributes: true, attributeFilter: ["data-status"] });
    update();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
