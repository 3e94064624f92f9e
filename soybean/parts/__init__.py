"""Parts of a graph on device groups: pipeline stages and placement regions, their prices and views."""
