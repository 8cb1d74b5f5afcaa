local moelua = require "moelua"
describe("host", function()
  it("runs a spec inside moelua", function()
    assert.are.same({2, 3}, moelua.zeros({2, 3}):shape())
  end)
end)
